// Transport on a dedicated NCCL communicator and CUDA streams: the GPU path of the runtime.
//
// Every collective runs on its own stream (all-gathers on one, reductions on another) after
// that stream waited for the caller's stream, so it sees what the caller wrote. Its handle
// holds an event recorded after the collective; wait() makes the caller's current stream
// wait on that event. Nothing here blocks the host, except the wait of a copy into host
// memory (the host is then the reader). Tensors used on a side stream are recorded on it
// (recordStream), so the caching allocator does not hand their memory out again before the
// side stream is done with them.
//
// Under CUDA graph capture (beginCapture .. endCapture) the side streams join the caller's
// capture, collectives are not watched (an event recorded in a capture cannot be queried), and
// handles never report completion: nothing queries or blocks the host on captured work.
#include "cuda/NcclComm.h"
#include "cuda/NcclWatchdog.h"
#include "dcplan/replayer/Transport.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <chrono>
#include <cstring>
#include <optional>
#include <stdexcept>

namespace dcplan::replayer {
namespace cuda {

// ---------------------------------------------------------------- NcclComm, StreamSet

std::unique_ptr<NcclComm> NcclComm::create(const ncclUniqueId& uniqueId, int rank, int worldSize,
                                           c10::DeviceIndex device) {
  TORCH_CHECK(worldSize >= 1 && rank >= 0 && rank < worldSize, "init_nccl: rank ", rank,
              " should be in [0, world_size = ", worldSize, ")");
  c10::cuda::CUDAGuard guard(device);
  ncclComm_t comm = nullptr;
  DCPLAN_NCCL_CHECK(ncclCommInitRank(&comm, worldSize, uniqueId, rank));
  return std::unique_ptr<NcclComm>(new NcclComm(comm, rank, worldSize, device));
}

void NcclComm::abort() {
  if (aborted_) return;
  aborted_ = true;
  c10::cuda::CUDAGuard guard(device_);
  (void)ncclCommAbort(comm_);
}

NcclComm::~NcclComm() {
  if (comm_ == nullptr || aborted_) return;
  // Destructors never throw: a failure here can only be ignored.
  try {
    c10::cuda::CUDAGuard guard(device_);
    (void)ncclCommDestroy(comm_);
  } catch (...) {
  }
}

StreamSet::StreamSet(c10::DeviceIndex device)
    : allGather(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)),
      reduceScatter(c10::cuda::getStreamFromPool(true, device)),
      offload(c10::cuda::getStreamFromPool(false, device)),
      reload(c10::cuda::getStreamFromPool(false, device)) {}

std::unique_ptr<StreamSet> StreamSet::create(c10::DeviceIndex device) {
  return std::unique_ptr<StreamSet>(new StreamSet(device));
}

std::unique_ptr<CudaEvent> CudaEvent::create(c10::DeviceIndex device) {
  c10::cuda::CUDAGuard guard(device);
  cudaEvent_t event = nullptr;
  DCPLAN_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return std::unique_ptr<CudaEvent>(new CudaEvent(event, device));
}

CudaEvent::~CudaEvent() {
  // CUDA releases an event with pending work once that work is done; never throws.
  (void)cudaEventDestroy(event_);
}

void CudaEvent::record(cudaStream_t stream) { DCPLAN_CUDA_CHECK(cudaEventRecord(event_, stream)); }

void CudaEvent::block(cudaStream_t stream) { DCPLAN_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0)); }

bool CudaEvent::query() {
  const cudaError_t err = cudaEventQuery(event_);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error: clear it
    return false;
  }
  DCPLAN_CUDA_CHECK(err);
  return true;
}

void CudaEvent::synchronize() { DCPLAN_CUDA_CHECK(cudaEventSynchronize(event_)); }

std::string newUniqueId() {
  ncclUniqueId id;
  DCPLAN_NCCL_CHECK(ncclGetUniqueId(&id));
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

namespace {

ncclDataType_t ncclTypeOf(const char* op, at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ncclFloat32;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kHalf:
      return ncclFloat16;
    case at::kDouble:
      return ncclFloat64;
    case at::kInt:
      return ncclInt32;
    case at::kLong:
      return ncclInt64;
    case at::kByte:
      return ncclUint8;
    case at::kChar:
      return ncclInt8;
    case at::kBool:
      return ncclUint8;
    default:
      TORCH_CHECK(false, op, ": NCCL has no data type for ", t);
  }
}

/// The end of work on a side stream. wait(): the caller's current stream waits for it
/// (or, with hostWait, the host does: the destination is host memory). Buffers allocated on
/// the side stream (gather outputs) are recorded on the waiting stream, so that their memory
/// is not reused before the work that stream queues on them has run. A handle of captured work
/// (captured) is a node of a CUDA graph: it never reports completion, and a host wait on it is
/// refused.
class EventHandle final : public CommHandle {
 public:
  EventHandle(std::shared_ptr<CudaEvent> done, c10::DeviceIndex device, bool hostWait, bool captured,
              const std::vector<at::Tensor>& usedByWaiter = {},
              std::optional<c10::cuda::CUDAStream> stream = {})
      : done_(std::move(done)), device_(device), hostWait_(hostWait), captured_(captured), stream_(stream) {
    // Weak: a fused gather's handle lives until its last member is waited on, and must not keep
    // the members released before that alive (the whole group's memory would stay until then).
    // A buffer freed before its wait was allocated on the collective's stream, which the
    // allocator reuses it on only after the collective (stream order).
    for (const at::Tensor& t : usedByWaiter) {
      if (t.numel() > 0) usedByWaiter_.push_back(t.storage().getWeakStorageImpl());
    }
  }

  /// The side stream the work ran on (absent for a host-side wait).
  const std::optional<c10::cuda::CUDAStream>& stream() const { return stream_; }

  void wait() override {
    c10::cuda::CUDAGuard guard(device_);
    if (hostWait_) {
      refuseHostWait("a copy into host memory (offload)");
      done_->synchronize();
      return;
    }
    const c10::cuda::CUDAStream waiter = c10::cuda::getCurrentCUDAStream(device_);
    done_->block(waiter.stream());
    for (const auto& weak : usedByWaiter_) {
      if (auto storage = weak.lock()) {
        c10::cuda::CUDACachingAllocator::recordStream(storage->data_ptr(), waiter);
      }
    }
  }
  bool isCompleted() override {
    if (captured_) return false;
    c10::cuda::CUDAGuard guard(device_);
    return done_->query();
  }
  void synchronize() override {
    refuseHostWait("a host wait on a collective");
    c10::cuda::CUDAGuard guard(device_);
    done_->synchronize();
  }

 private:
  void refuseHostWait(const char* what) const {
    TORCH_CHECK(!captured_, what,
                " cannot be captured in a CUDA graph: the host would wait for work that "
                "runs only when the graph is replayed (dcplan.graphed_step; docs/compiled.md)");
  }

  std::shared_ptr<CudaEvent> done_;
  c10::DeviceIndex device_;
  bool hostWait_;
  bool captured_;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> usedByWaiter_;
  std::optional<c10::cuda::CUDAStream> stream_;
};

class NcclTransport final : public Transport {
 public:
  NcclTransport(std::unique_ptr<NcclComm> comm, std::unique_ptr<StreamSet> streams,
                std::chrono::milliseconds timeout)
      : comm_(std::move(comm)),
        streams_(std::move(streams)),
        device_(comm_->device()),
        watchdog_(std::make_unique<NcclWatchdog>(*comm_, timeout)) {}

  ~NcclTransport() override {
    // Work queued on the side streams may still use the communicator (the watchdog, still
    // running, aborts it if that work never ends).
    try {
      c10::cuda::CUDAGuard guard(device_);
      (void)cudaStreamSynchronize(streams_->allGather.stream());
      (void)cudaStreamSynchronize(streams_->reduceScatter.stream());
      (void)cudaStreamSynchronize(streams_->offload.stream());
      (void)cudaStreamSynchronize(streams_->reload.stream());
    } catch (...) {
    }
  }

  int rank() const override { return comm_->rank(); }
  int worldSize() const override { return comm_->worldSize(); }
  std::string backendName() const override { return "nccl"; }

  CommHandlePtr allGather(const at::Tensor& output, const at::Tensor& input) override {
    TORCH_CHECK(output.is_contiguous() && input.is_contiguous(), "allGather: tensors should be contiguous");
    TORCH_CHECK(output.numel() == worldSize() * input.numel(), "allGather: output should have world_size * ",
                input.numel(), " elements, got ", output.numel());
    TORCH_CHECK(output.scalar_type() == input.scalar_type(), "allGather: output dtype ", output.scalar_type(),
                " differs from input dtype ", input.scalar_type());
    return launch("allGather", streams_->allGather, {output, input}, [&](cudaStream_t s) {
      if (input.numel() == 0) return;
      DCPLAN_NCCL_CHECK_COMM(ncclAllGather(input.data_ptr(), output.data_ptr(), input.numel(),
                                           ncclTypeOf("allGather", input.scalar_type()), comm_->get(), s),
                             comm_->get());
    });
  }

  CommHandlePtr allGatherCoalesced(const std::vector<at::Tensor>& outputs,
                                   const std::vector<at::Tensor>& inputs) override {
    TORCH_CHECK(outputs.size() == inputs.size(), "allGatherCoalesced: ", outputs.size(), " outputs for ",
                inputs.size(), " inputs");
    std::vector<at::Tensor> all;
    for (size_t i = 0; i < inputs.size(); ++i) {
      TORCH_CHECK(outputs[i].is_contiguous() && inputs[i].is_contiguous() &&
                      outputs[i].numel() == worldSize() * inputs[i].numel() &&
                      outputs[i].scalar_type() == inputs[i].scalar_type(),
                  "allGatherCoalesced: output ", i, " should be contiguous with world_size * ",
                  inputs[i].numel(), " elements of ", inputs[i].scalar_type(), ", got ", outputs[i].numel(),
                  " of ", outputs[i].scalar_type());
      all.push_back(outputs[i]);
      all.push_back(inputs[i]);
    }
    // One NCCL group: the gathers go out as one launch, straight into the padded buffers.
    return launch("allGatherCoalesced", streams_->allGather, all, [&](cudaStream_t s) {
      DCPLAN_NCCL_CHECK_COMM(ncclGroupStart(), comm_->get());
      for (size_t i = 0; i < inputs.size(); ++i) {
        if (inputs[i].numel() == 0) continue;
        DCPLAN_NCCL_CHECK_COMM(
            ncclAllGather(inputs[i].data_ptr(), outputs[i].data_ptr(), inputs[i].numel(),
                          ncclTypeOf("allGatherCoalesced", inputs[i].scalar_type()), comm_->get(), s),
            comm_->get());
      }
      DCPLAN_NCCL_CHECK_COMM(ncclGroupEnd(), comm_->get());
    });
  }

  // Shard gathers do not wait for the caller's whole queue (the previous layer's compute),
  // only for the last point where shards were written, so with gather-on-use they still
  // overlap compute (as FSDP2's copy-in stream does). Their outputs are allocated on the
  // gather stream, so the allocator orders reuse of that memory on it.
  at::Tensor newGatherBuffer(int64_t numel, const at::TensorOptions& options) override {
    c10::cuda::CUDAGuard guard(device_);
    c10::cuda::CUDAStreamGuard onStream(streams_->allGather);
    return at::empty({numel}, options.device(c10::Device(c10::kCUDA, device_)));
  }

  void shardsWritten() override {
    c10::cuda::CUDAGuard guard(device_);
    if (!shardsWritten_) shardsWritten_ = CudaEvent::create(device_);
    shardsWritten_->record(c10::cuda::getCurrentCUDAStream(device_).stream());
  }

  // On the reload stream: the gather waits for the copy (reloaded_), the caller's stream does not,
  // so a prefetched shard comes in beside the compute queued after its prefetch.
  void reloadShard(const at::Tensor& shard, const at::Tensor& host) override {
    checkDevice("reloadShard", shard);
    if (!host.is_pinned()) {  // a pageable copy would block the host: on the caller's side
      Transport::reloadShard(shard, host);
      return;
    }
    reloaded_.push_back(copyOn(streams_->reload, shard, host, shard));
  }

  CommHandlePtr gatherShards(const std::vector<at::Tensor>& outputs,
                             const std::vector<at::Tensor>& shards) override {
    TORCH_CHECK(outputs.size() == shards.size(), "gatherShards: ", outputs.size(), " outputs for ",
                shards.size(), " shards");
    for (size_t i = 0; i < shards.size(); ++i) {
      checkDevice("gatherShards", outputs[i]);
      checkDevice("gatherShards", shards[i]);
      TORCH_CHECK(outputs[i].is_contiguous() && shards[i].is_contiguous() &&
                      outputs[i].numel() == worldSize() * shards[i].numel(),
                  "gatherShards: output ", i, " should be contiguous with world_size * ", shards[i].numel(),
                  " elements, got ", outputs[i].numel());
    }
    refuseAfterFailure("gatherShards");
    c10::cuda::CUDAGuard guard(device_);
    const c10::cuda::CUDAStream stream = streams_->allGather;
    if (shardsWritten_) {
      shardsWritten_->block(stream.stream());
    } else {
      waitForCaller(stream);  // no step boundary seen yet: wait for everything
    }
    for (const std::unique_ptr<CudaEvent>& copied : reloaded_) copied->block(stream.stream());
    reloaded_.clear();
    std::vector<at::Tensor> sends;
    {
      // In place: each shard goes, cast to the gather dtype where it differs, straight into this
      // rank's slot of the output, which NCCL gathers from. No temporary is allocated, and where
      // the output is the whole collective (one rank) nothing is copied again.
      c10::cuda::CUDAStreamGuard onStream(stream);
      for (size_t i = 0; i < shards.size(); ++i) {
        const int64_t n = shards[i].numel();
        at::Tensor mine = outputs[i].narrow(0, static_cast<int64_t>(rank()) * n, n);
        mine.copy_(shards[i]);
        sends.push_back(std::move(mine));
      }
      DCPLAN_NCCL_CHECK_COMM(ncclGroupStart(), comm_->get());
      for (size_t i = 0; i < sends.size(); ++i) {
        if (sends[i].numel() == 0) continue;
        DCPLAN_NCCL_CHECK_COMM(
            ncclAllGather(sends[i].data_ptr(), outputs[i].data_ptr(), sends[i].numel(),
                          ncclTypeOf("gatherShards", sends[i].scalar_type()), comm_->get(), stream.stream()),
            comm_->get());
      }
      DCPLAN_NCCL_CHECK_COMM(ncclGroupEnd(), comm_->get());
    }
    std::shared_ptr<CudaEvent> done = CudaEvent::create(device_);
    done->record(stream.stream());
    if (!capturing_) watchdog_->watch("gatherShards", done);
    return std::make_shared<EventHandle>(std::move(done), device_, /*hostWait=*/false, capturing_, outputs);
  }

  CommHandlePtr reduceScatter(const at::Tensor& output, const at::Tensor& input) override {
    const int ws = worldSize();
    TORCH_CHECK(input.dim() == 2 && input.size(0) == ws && input.size(1) == output.numel(),
                "reduceScatter: input should be [world_size, ", output.numel(), "], got ", input.sizes());
    TORCH_CHECK(output.is_contiguous() && output.scalar_type() == input.scalar_type(),
                "reduceScatter: output should be contiguous and of the input's dtype");
    if (reducesAloneInPlace(output, input)) return doneHandle();
    // A bucket that is not full has strided rows: NCCL needs them back to back.
    const at::Tensor send = input.is_contiguous() ? input : input.contiguous();
    return launch("reduceScatter", streams_->reduceScatter, {output, send}, [&](cudaStream_t s) {
      if (output.numel() == 0) return;
      DCPLAN_NCCL_CHECK_COMM(
          ncclReduceScatter(send.data_ptr(), output.data_ptr(), output.numel(),
                            ncclTypeOf("reduceScatter", output.scalar_type()), ncclSum, comm_->get(), s),
          comm_->get());
    });
  }

  CommHandlePtr allReduce(const at::Tensor& tensor) override {
    TORCH_CHECK(tensor.is_contiguous(), "allReduce: tensor should be contiguous");
    return launch("allReduce", streams_->reduceScatter, {tensor}, [&](cudaStream_t s) {
      if (tensor.numel() == 0) return;
      DCPLAN_NCCL_CHECK_COMM(
          ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                        ncclTypeOf("allReduce", tensor.scalar_type()), ncclSum, comm_->get(), s),
          comm_->get());
    });
  }

  CommHandlePtr markCaller() override {
    c10::cuda::CUDAGuard guard(device_);
    auto mark = CudaEvent::create(device_);
    mark->record(c10::cuda::getCurrentCUDAStream(device_).stream());
    return std::make_shared<EventHandle>(std::move(mark), device_, /*hostWait=*/false, capturing_);
  }

  // Gradient accumulation after a reduction runs on the reduction's stream, so backward's
  // compute never waits for a reduction (only end_backward does).
  CommHandlePtr runAfter(const CommHandlePtr& done, const std::function<void()>& work) override {
    auto* event = dynamic_cast<EventHandle*>(done.get());
    if (event == nullptr || !event->stream()) return Transport::runAfter(done, work);
    const c10::cuda::CUDAStream side = *event->stream();
    c10::cuda::CUDAGuard guard(device_);
    // Memory the caller allocated for work may have been used by its queue until now.
    waitForCaller(side);
    {
      c10::cuda::CUDAStreamGuard onStream(side);
      work();
    }
    auto end = CudaEvent::create(device_);
    end->record(side.stream());
    return std::make_shared<EventHandle>(std::move(end), device_, /*hostWait=*/false, capturing_,
                                         std::vector<at::Tensor>{}, side);
  }

  CommHandlePtr copyAsync(const at::Tensor& dst, const at::Tensor& src, CopyKind kind) override {
    const char* op = kind == CopyKind::Offload ? "offload" : "reload";
    TORCH_CHECK(dst.sizes() == src.sizes() && dst.scalar_type() == src.scalar_type(), op, ": copy of ",
                src.sizes(), " ", src.scalar_type(), " into ", dst.sizes(), " ", dst.scalar_type());
    const at::Tensor& devSide = kind == CopyKind::Offload ? src : dst;
    const at::Tensor& hostSide = kind == CopyKind::Offload ? dst : src;
    TORCH_CHECK(devSide.is_cuda() && hostSide.is_cpu(), op, ": expected a copy between ", device_,
                " and host memory, got ", src.device(), " -> ", dst.device());
    TORCH_CHECK(hostSide.is_pinned(), op, ": the host tensor should be in pinned memory");
    std::shared_ptr<CudaEvent> done =
        copyOn(kind == CopyKind::Offload ? streams_->offload : streams_->reload, dst, src, devSide);
    return std::make_shared<EventHandle>(std::move(done), device_, /*hostWait=*/kind == CopyKind::Offload,
                                         capturing_);
  }

 private:
  /// dst <- src on `stream` (one of the copy streams) once the caller's work queued so far has run,
  /// the device side's block kept from reuse until the copy is done; the copy's end, as an event.
  std::unique_ptr<CudaEvent> copyOn(c10::cuda::CUDAStream stream, const at::Tensor& dst, const at::Tensor& src,
                                    const at::Tensor& devSide) {
    c10::cuda::CUDAGuard guard(device_);
    waitForCaller(stream);
    recordOn(stream, {devSide});
    {
      c10::cuda::CUDAStreamGuard onStream(stream);
      dst.copy_(src, /*non_blocking=*/true);
    }
    auto done = CudaEvent::create(device_);
    done->record(stream.stream());
    return done;
  }

  void beginCapture() override {
    c10::cuda::CUDAGuard guard(device_);
    TORCH_CHECK(c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::Active,
                "begin_capture: the current stream of cuda:", int(device_), " is not capturing a CUDA graph");
    TORCH_CHECK(!capturing_, "begin_capture: a capture is already under way");
    // Each side stream waits for the capturing stream, which makes it part of the capture: its
    // work becomes graph nodes and its allocations come from the graph's memory pool.
    for (const c10::cuda::CUDAStream& side : streams_->all()) waitForCaller(side);
    capturing_ = true;
  }

  void endCapture() override {
    TORCH_CHECK(capturing_, "end_capture: no capture under way (begin_capture first)");
    c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t caller = c10::cuda::getCurrentCUDAStream(device_).stream();
    for (const c10::cuda::CUDAStream& side : streams_->all()) {
      auto last = CudaEvent::create(device_);
      last->record(side.stream());
      last->block(caller);
    }
    capturing_ = false;
  }

  bool capturing() const override { return capturing_; }

  void checkDevice(const char* op, const at::Tensor& t) const {
    TORCH_CHECK(t.is_cuda() && t.device().index() == device_, op, ": tensor should be on cuda:", int(device_),
                " (the device of the NCCL communicator), got ", t.device());
  }

  /// The side stream waits for everything the caller's stream queued so far.
  void waitForCaller(c10::cuda::CUDAStream side) {
    auto ready = CudaEvent::create(device_);
    ready->record(c10::cuda::getCurrentCUDAStream(device_).stream());
    ready->block(side.stream());
  }

  static void recordOn(c10::cuda::CUDAStream side, const std::vector<at::Tensor>& tensors) {
    for (const at::Tensor& t : tensors) {
      if (t.numel() > 0 && t.is_cuda())
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), side);
    }
  }

  /// After the watchdog aborted the communicator, nothing may use it: a std::runtime_error
  /// (the runtime takes it as a failed collective, names the op and stops).
  void refuseAfterFailure(const char* op) {
    const std::string failure = watchdog_->failure();
    if (!failure.empty())
      throw std::runtime_error(std::string(op) + " on rank " + std::to_string(rank()) + ": " + failure);
  }

  template <class Body>
  CommHandlePtr launch(const char* op, c10::cuda::CUDAStream side, const std::vector<at::Tensor>& tensors,
                       Body&& body) {
    refuseAfterFailure(op);
    for (const at::Tensor& t : tensors) checkDevice(op, t);
    c10::cuda::CUDAGuard guard(device_);
    waitForCaller(side);
    recordOn(side, tensors);
    body(side.stream());
    std::shared_ptr<CudaEvent> done = CudaEvent::create(device_);
    done->record(side.stream());
    if (!capturing_) watchdog_->watch(op, done);
    return std::make_shared<EventHandle>(std::move(done), device_, /*hostWait=*/false, capturing_,
                                         std::vector<at::Tensor>{}, side);
  }

  std::unique_ptr<NcclComm> comm_;
  std::unique_ptr<StreamSet> streams_;
  c10::DeviceIndex device_;
  std::unique_ptr<CudaEvent> shardsWritten_;  // recorded by shardsWritten() on the caller's stream
  std::vector<std::unique_ptr<CudaEvent>> reloaded_;  // reloadShard copies the next gather waits for
  bool capturing_ = false;                    // between beginCapture and endCapture
  std::unique_ptr<NcclWatchdog> watchdog_;    // last: stopped first, after the destructor's stream syncs
};

}  // namespace
}  // namespace cuda

bool hasNcclTransport() { return true; }

std::string makeNcclUniqueId() { return cuda::newUniqueId(); }

std::shared_ptr<Transport> makeNcclTransport(const std::string& uniqueId, int rank, int worldSize,
                                             int deviceIndex, std::chrono::milliseconds timeout) {
  TORCH_CHECK(timeout.count() > 0, "init_nccl: timeout should be > 0 ms, got ", timeout.count());
  TORCH_CHECK(uniqueId.size() == sizeof(ncclUniqueId), "init_nccl: unique_id should have ",
              sizeof(ncclUniqueId), " bytes (from nccl_unique_id()), got ", uniqueId.size());
  TORCH_CHECK(deviceIndex >= 0 && deviceIndex < c10::cuda::device_count(), "init_nccl: device ", deviceIndex,
              " should be in [0, ", int(c10::cuda::device_count()), ")");
  ncclUniqueId id;
  std::memcpy(&id, uniqueId.data(), sizeof(id));
  const auto device = static_cast<c10::DeviceIndex>(deviceIndex);
  auto streams = cuda::StreamSet::create(device);
  auto comm = cuda::NcclComm::create(id, rank, worldSize, device);
  return std::make_shared<cuda::NcclTransport>(std::move(comm), std::move(streams), timeout);
}

}  // namespace dcplan::replayer
