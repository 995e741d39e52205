// The runtime: parameter registry, reduce buckets, ZeRO-1/2/3 executors and the op entry points.
#include "Executor.h"

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <utility>

namespace dcplan::replayer {

namespace {

std::mutex gMutex;
std::unique_ptr<RuntimeState> gState;

RuntimeState& state(const char* op) {
  TORCH_CHECK(gState != nullptr, op, ": the dc runtime is not initialized; call dcplan._C.init() first");
  return *gState;
}

Executor& executor(const char* op, int64_t graphId) {
  auto& rt = state(op);
  auto it = rt.executors_.find(graphId);
  TORCH_CHECK(it != rt.executors_.end(), op, ": graph_id ", graphId,
              " is not registered; register it with register_graph_z1/z2/z3 first");
  return *it->second;
}

/// Parameter dsId, which must be trainable without a registered gradient buffer (its
/// gradient is the caller's to give and take).
Param& callerGradParam(RuntimeState& rt, const char* op, int64_t dsId) {
  Param& p = rt.registry_->get(op, dsId);
  TORCH_CHECK(p.trainable_ && !p.fixedGrad_, op, ": ds_id ", dsId,
              p.trainable_ ? " has a registered grad_buffer" : " is frozen (registered as not trainable)");
  return p;
}

std::string shapeString(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

/// Reports an op to the observer on construction and destruction.
class ObserverScope {
 public:
  ObserverScope(RuntimeState& rt, OpEvent event) : rt_(rt), event_(event) {
    if (rt_.observer_) rt_.observer_->onOpBegin(event_);
  }
  ~ObserverScope() {
    if (rt_.observer_) {
      try {
        rt_.observer_->onOpEnd(event_);
      } catch (...) {
        // An observer must not turn a finished op into a failure.
      }
    }
  }
  ObserverScope(const ObserverScope&) = delete;
  ObserverScope& operator=(const ObserverScope&) = delete;

 private:
  RuntimeState& rt_;
  OpEvent event_;
};

/// Frees a tensor's storage (its memory goes back to the allocator) while
/// keeping the tensor object; restoreStorage gives it memory back.
void freeStorage(const at::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

void restoreStorage(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  c10::Allocator* allocator = impl->allocator();
  TORCH_INTERNAL_ASSERT(allocator != nullptr, "storage without allocator cannot be restored");
  impl->set_data_ptr_noswap(allocator->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

/// Bytes a gather of p in dtype receives; 0 when a copy in that dtype is held
/// (the op is then served without communication).
int64_t gatherBytes(const Param& p, at::ScalarType dtype, int worldSize) {
  if (p.hasGathered() && p.gathered_.scalar_type() == dtype) return 0;
  return worldSize * p.shardNumel_ * static_cast<int64_t>(c10::elementSize(dtype));
}

int64_t tensorBytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

/// Tells the schedule which of dsIds a gather launched now would really gather
/// (those holding no copy in their dtype) and how many bytes that receives.
void reportGathers(RuntimeState& rt, Executor& ex, int64_t graphId, const std::vector<int64_t>& dsIds,
                   const std::vector<at::ScalarType>& types, bool planned) {
  std::vector<int64_t> launched;
  int64_t bytes = 0;
  for (size_t i = 0; i < dsIds.size(); ++i) {
    if (std::find(launched.begin(), launched.end(), dsIds[i]) != launched.end()) continue;
    const int64_t b =
        gatherBytes(ex.param("prefetch_params_fused", dsIds[i]), types[i], rt.transport_->worldSize());
    if (b == 0) continue;
    launched.push_back(dsIds[i]);
    bytes += b;
  }
  if (planned || !launched.empty()) rt.schedule_->onGatherLaunched(graphId, launched, bytes, planned);
}

/// The schedule's turn before an op a hook issued: it may stop at a departure
/// from a plan, and the executor launches the gathers it plans there.
void scheduleBefore(RuntimeState& rt, const OpEvent& event) {
  std::vector<SchedulePolicy::Prefetch> groups = rt.schedule_->beforeOp(event);
  if (groups.empty()) return;
  auto it = rt.executors_.find(event.graphId);
  TORCH_CHECK(it != rt.executors_.end(), event.op, ": graph_id ", event.graphId,
              " is not registered; register it with register_graph_z1/z2/z3 first");
  Executor& ex = *it->second;
  for (const SchedulePolicy::Prefetch& group : groups) {
    std::vector<at::ScalarType> types;
    for (int64_t id : group.dsIds) {
      Param& p = ex.param(event.op, id);
      types.push_back(group.dtype == at::ScalarType::Undefined ? p.shard_.scalar_type() : group.dtype);
    }
    reportGathers(rt, ex, event.graphId, group.dsIds, types, /*planned=*/true);
    if (!group.dsIds.empty()) ex.prefetchParamsFused(group.dsIds, types);
  }
}

}  // namespace

// ---------------------------------------------------------------- ParamRegistry

void ParamRegistry::registerParam(int64_t dsId, const std::vector<int64_t>& shape, const at::Tensor& shard,
                                  const at::Tensor& gradBuffer, bool persistent, bool trainable) {
  TORCH_CHECK(dsId >= 0, "register_param: ds_id should be >= 0, got ", dsId);
  TORCH_CHECK(!contains(dsId), "register_param: ds_id ", dsId, " is already registered");
  int64_t numel = 1;
  for (int64_t d : shape) {
    TORCH_CHECK(d >= 0, "register_param: ds_id ", dsId, ": shape should have dims >= 0, got ",
                shapeString(shape));
    numel *= d;
  }
  const int64_t shardNumel = shardNumelOf(numel, worldSize_);
  TORCH_CHECK(shard.defined() && shard.dim() == 1 && shard.is_contiguous(), "register_param: ds_id ", dsId,
              ": ds_tensor should be a contiguous 1-D tensor");
  TORCH_CHECK(shard.numel() == shardNumel, "register_param: ds_id ", dsId,
              ": ds_tensor should have ceil(numel/world_size) = ", shardNumel, " elements for shape ",
              shapeString(shape), " and world size ", worldSize_, ", got ", shard.numel());
  if (gradBuffer.defined()) {
    TORCH_CHECK(gradBuffer.dim() == 1 && gradBuffer.is_contiguous() && gradBuffer.numel() == shardNumel,
                "register_param: ds_id ", dsId, ": grad_buffer should be a contiguous 1-D tensor of ",
                shardNumel, " elements, got ", gradBuffer.sizes());
    TORCH_CHECK(gradBuffer.device() == shard.device(), "register_param: ds_id ", dsId,
                ": grad_buffer should be on ", shard.device(), ", got ", gradBuffer.device());
  }
  Param p;
  p.id_ = dsId;
  p.shape_ = shape;
  p.numel_ = numel;
  p.shardNumel_ = shardNumel;
  p.shard_ = shard;
  p.trainable_ = trainable || gradBuffer.defined();
  p.grad_ = gradBuffer;
  p.fixedGrad_ = gradBuffer.defined();
  p.persistent_ = persistent;
  params_.emplace(dsId, std::move(p));
}

Param& ParamRegistry::get(const char* op, int64_t dsId) {
  auto it = params_.find(dsId);
  TORCH_CHECK(it != params_.end(), op, ": ds_id ", dsId,
              " is not registered; register it with register_param first");
  return it->second;
}

void ParamRegistry::boundReleaseLag() {
  while (!released_.empty() &&
         (releasedBytes_ > maxReleaseLagBytes_ || released_.front().first->isCompleted())) {
    released_.front().first->synchronize();
    releasedBytes_ -= released_.front().second;
    released_.pop_front();
  }
}

void ParamRegistry::startGather(Param& p, at::ScalarType dtype, Transport& transport) {
  if (p.hasGathered() && p.gathered_.scalar_type() == dtype) return;
  dropGathered(p);
  boundReleaseLag();
  if (p.offloaded_) {
    reload(p);
    transport.shardsWritten();  // the reload wrote the shard on the caller's stream
  }
  const int64_t ws = worldSize_;
  p.gatheredBuffer_ = transport.newGatherBuffer(ws * p.shardNumel_, p.shard_.options().dtype(dtype));
  p.gathered_ = p.gatheredBuffer_.narrow(0, 0, p.numel_).view(p.shape_);
  p.gatherHandle_ = transport.gatherShards({p.gatheredBuffer_}, {p.shard_});
  p.valid_ = false;
}

void ParamRegistry::startGatherFused(const std::vector<Param*>& ps, const std::vector<at::ScalarType>& dtypes,
                                     Transport& transport) {
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> inputs;
  std::vector<Param*> launched;
  for (size_t i = 0; i < ps.size(); ++i) {
    Param& p = *ps[i];
    if (p.hasGathered() && p.gathered_.scalar_type() == dtypes[i]) continue;
    if (std::find(launched.begin(), launched.end(), &p) != launched.end()) continue;
    dropGathered(p);
    boundReleaseLag();
    if (p.offloaded_) {
      reload(p);
      transport.shardsWritten();  // the reload wrote the shard on the caller's stream
    }
    p.gatheredBuffer_ =
        transport.newGatherBuffer(worldSize_ * p.shardNumel_, p.shard_.options().dtype(dtypes[i]));
    p.gathered_ = p.gatheredBuffer_.narrow(0, 0, p.numel_).view(p.shape_);
    p.valid_ = false;
    outputs.push_back(p.gatheredBuffer_);
    inputs.push_back(p.shard_);
    launched.push_back(&p);
  }
  if (launched.empty()) return;
  CommHandlePtr handle = transport.gatherShards(outputs, inputs);
  for (Param* p : launched) p->gatherHandle_ = handle;
}

void ParamRegistry::waitGather(Param& p) {
  if (p.gatherHandle_) {
    // A fused handle is shared; waiting on it twice is a no-op for the second.
    p.gatherHandle_->wait();
    p.gatherHandle_.reset();
  }
  if (p.hasGathered()) p.valid_ = true;
}

void ParamRegistry::dropGathered(Param& p) {
  if (p.gatherHandle_) {
    p.gatherHandle_->wait();  // the buffer must outlive the collective writing it
    p.gatherHandle_.reset();
  }
  if (p.gatheredBuffer_.defined() && maxReleaseLagBytes_ >= 0) {
    CommHandlePtr used = transport_.markCaller();
    if (!used->isCompleted()) {
      const int64_t bytes =
          p.gatheredBuffer_.numel() * static_cast<int64_t>(p.gatheredBuffer_.element_size());
      released_.emplace_back(std::move(used), bytes);
      releasedBytes_ += bytes;
    }
  }
  p.gathered_ = at::Tensor();
  p.gatheredBuffer_ = at::Tensor();
  p.valid_ = false;
  p.uses_ = 0;
}

void ParamRegistry::offload(Param& p) {
  if (p.offloaded_) return;
  // Host memory is plain CPU memory; a device shard gets a pinned copy.
  const bool onHost = p.shard_.device().is_cpu();
  p.host_ = at::empty_like(p.shard_, p.shard_.options().device(at::kCPU).pinned_memory(!onHost));
  p.host_.copy_(p.shard_);
  freeStorage(p.shard_);
  p.offloaded_ = true;
}

void ParamRegistry::reload(Param& p) {
  if (!p.offloaded_) return;
  restoreStorage(p.shard_, static_cast<size_t>(tensorBytes(p.shard_)));
  p.shard_.copy_(p.host_);
  p.host_ = at::Tensor();
  p.offloaded_ = false;
}

// ---------------------------------------------------------------- ReduceBucket

ReduceBucket::ReduceBucket(at::ScalarType dtype, c10::Device device, int worldSize, bool rankMajor,
                           int64_t capacityBytes)
    : dtype_(dtype), device_(device), worldSize_(worldSize), rankMajor_(rankMajor) {
  const int64_t elemBytes = static_cast<int64_t>(c10::elementSize(dtype));
  capacityCols_ = std::max<int64_t>(1, capacityBytes / (elemBytes * worldSize));
  configuredCols_ = capacityCols_;
}

void ReduceBucket::reserveCols(int64_t cols) {
  if (buffer_.defined() && usedCols_ + cols <= capacityCols_) return;
  const int64_t newCap = std::max(capacityCols_, usedCols_ + cols);
  at::Tensor fresh = at::empty({worldSize_ * newCap}, at::TensorOptions().dtype(dtype_).device(device_));
  if (buffer_.defined() && usedCols_ > 0) {
    if (rankMajor_) {
      fresh.view({worldSize_, newCap})
          .narrow(1, 0, usedCols_)
          .copy_(buffer_.view({worldSize_, capacityCols_}).narrow(1, 0, usedCols_));
    } else {
      fresh.narrow(0, 0, worldSize_ * usedCols_).copy_(buffer_.narrow(0, 0, worldSize_ * usedCols_));
    }
  }
  buffer_ = fresh;
  capacityCols_ = newCap;
}

at::Tensor ReduceBucket::allocate(int64_t dsId, int64_t cols) {
  TORCH_INTERNAL_ASSERT(pending_ == nullptr, "filling a bucket whose reduction is in flight");
  reserveCols(cols);
  tasks_.push_back(ReduceTask{dsId, usedCols_, cols});
  usedCols_ += cols;
  return region(tasks_.back());
}

void ReduceBucket::defer(int64_t dsId, int64_t cols, const at::Tensor& gradFlat) {
  TORCH_INTERNAL_ASSERT(pending_ == nullptr, "filling a bucket whose reduction is in flight");
  TORCH_INTERNAL_ASSERT(rankMajor_ && !buffer_.defined(), "defer() fills a packed or flat bucket");
  tasks_.push_back(ReduceTask{dsId, usedCols_, cols});
  usedCols_ += cols;
  if (cols > 0) deferred_.push_back(gradFlat);
}

void ReduceBucket::pack() {
  if (buffer_.defined()) return;
  buffer_ = at::empty({worldSize_ * usedCols_}, at::TensorOptions().dtype(dtype_).device(device_));
  capacityCols_ = usedCols_;
  if (!deferred_.empty()) {
    at::Tensor out = buffer_.view({worldSize_, usedCols_});
    at::_chunk_cat_out(out, deferred_, 0, worldSize_);
  }
  deferred_.clear();
}

at::Tensor ReduceBucket::region(const ReduceTask& task) const {
  if (rankMajor_) {
    return buffer_.view({worldSize_, capacityCols_}).narrow(1, task.colOffset_, task.cols_);
  }
  return buffer_.narrow(0, worldSize_ * task.colOffset_, worldSize_ * task.cols_)
      .view({worldSize_, task.cols_});
}

at::Tensor ReduceBucket::commInput() const {
  if (rankMajor_) return buffer_.view({worldSize_, capacityCols_}).narrow(1, 0, usedCols_);
  return buffer_.narrow(0, 0, worldSize_ * usedCols_);
}

int64_t ReduceBucket::usedBytes() const {
  return worldSize_ * usedCols_ * static_cast<int64_t>(c10::elementSize(dtype_));
}

void ReduceBucket::releaseMemory() {
  TORCH_INTERNAL_ASSERT(empty() && !pending_, "releasing a bucket that holds gradients");
  buffer_ = at::Tensor();
  capacityCols_ = configuredCols_;
}

void ReduceBucket::reset() {
  tasks_.clear();
  deferred_.clear();
  usedCols_ = 0;
  pending_.reset();
  output_ = at::Tensor();
}

ReduceBucket& DoubleBufferedReduceBucket::current(at::ScalarType dtype, c10::Device device) {
  Pair& p = pair(dtype, device);
  return *p.buckets[p.current];
}

ReduceBucket& DoubleBufferedReduceBucket::swap(at::ScalarType dtype) {
  Pair& p = pair(dtype);
  if (doubleBuffer_) p.current = 1 - p.current;
  return *p.buckets[p.current];
}

std::vector<ReduceBucket*> DoubleBufferedReduceBucket::all() {
  std::vector<ReduceBucket*> out;
  for (auto& [dtype, p] : pairs_) {
    // The non-current bucket was flushed first, so complete it first.
    out.push_back(p.buckets[1 - p.current].get());
    out.push_back(p.buckets[p.current].get());
  }
  return out;
}

DoubleBufferedReduceBucket::Pair& DoubleBufferedReduceBucket::pair(at::ScalarType dtype, c10::Device device) {
  auto it = pairs_.find(dtype);
  if (it != pairs_.end()) return it->second;
  Pair p;
  for (auto& b : p.buckets) {
    b = std::make_unique<ReduceBucket>(dtype, device, worldSize_, rankMajor_, capacityBytes_);
  }
  return pairs_.emplace(dtype, std::move(p)).first->second;
}

// ---------------------------------------------------------------- Executor

Executor::Executor(int64_t graphId, Stage stage, std::vector<int64_t> dsIds,
                   std::optional<at::ScalarType> reduceDtype, RuntimeState& rt)
    : graphId_(graphId), stage_(stage), dsIds_(std::move(dsIds)), reduceDtype_(reduceDtype), rt_(rt) {
  for (int64_t id : dsIds_) {
    rt_.registry_->get("register_graph", id);  // fails for unknown ids
    TORCH_CHECK(!inGraph_.count(id), "register_graph: graph_id ", graphId, " lists ds_id ", id, " twice");
    inGraph_[id] = true;
  }
  buckets_ = std::make_unique<DoubleBufferedReduceBucket>(
      rt_.transport_->worldSize(), /*rankMajor=*/stage != Stage::Zero1, rt_.config_.reduceBucketBytes,
      rt_.config_.doubleBuffer);
}

Param& Executor::param(const char* op, int64_t dsId) {
  Param& p = rt_.registry_->get(op, dsId);
  TORCH_CHECK(inGraph_.count(dsId), op, ": ds_id ", dsId, " is not a parameter of graph_id ", graphId_);
  return p;
}

at::Tensor Executor::allgatherParam(const at::Tensor& shard, int64_t dsId,
                                    std::optional<at::ScalarType> dtype) {
  Param& p = param("allgather_param", dsId);
  TORCH_CHECK(shard.numel() == p.shardNumel_ || p.offloaded_, "allgather_param: ds_id ", dsId,
              ": the tensor should be the registered shard of ", p.shardNumel_, " elements, got ",
              shard.numel());
  const at::ScalarType gatherType = dtype.value_or(p.shard_.scalar_type());
  std::vector<int64_t> ahead = rt_.schedule_->prefetchBefore(OpEvent{
      "allgather_param", graphId_, dsId, p.numel_ * int64_t(c10::elementSize(gatherType)), gatherType});
  if (!ahead.empty()) {
    prefetchParamsFused(ahead, std::vector<at::ScalarType>(ahead.size(), gatherType));
  }
  rt_.registry_->startGather(p, gatherType, *rt_.transport_);
  return p.gathered_;
}

void Executor::prefetchParamsFused(const std::vector<int64_t>& dsIds,
                                   const std::vector<at::ScalarType>& dtypes) {
  std::vector<Param*> ps;
  ps.reserve(dsIds.size());
  for (int64_t id : dsIds) ps.push_back(&param("prefetch_params_fused", id));
  rt_.registry_->startGatherFused(ps, dtypes, *rt_.transport_);
}

at::Tensor Executor::waitAllgather(const at::Tensor& gathered, int64_t dsId) {
  Param& p = param("wait_allgather", dsId);
  TORCH_CHECK(p.hasGathered(), "wait_allgather: ds_id ", dsId,
              " has no gather in flight or held; call allgather_param first");
  rt_.registry_->waitGather(p);
  return gathered;
}

void Executor::releaseParam(int64_t dsId, int64_t nUsers) {
  Param& p = param("release_param", dsId);
  TORCH_CHECK(nUsers >= 1, "release_param: n_users should be >= 1, got ", nUsers, " for ds_id ", dsId);
  if (++p.uses_ < nUsers) return;
  p.uses_ = 0;
  const bool keep = !rt_.profiling_ && rt_.schedule_->keepGathered(dsId, p.persistent_, keepsAllGathered());
  if (!keep) rt_.registry_->dropGathered(p);
}

void Executor::reduceGrad(const at::Tensor& grad, int64_t dsId) {
  Param& p = param("reduce_grad", dsId);
  TORCH_CHECK(p.trainable(), "reduce_grad: ds_id ", dsId,
              " was registered without a gradient buffer (frozen); it takes no gradient");
  TORCH_CHECK(grad.numel() == p.numel_, "reduce_grad: ds_id ", dsId, ": gradient should have shape ",
              shapeString(p.shape_), " (", p.numel_, " elements), got ", grad.sizes());
  addGrad(p, grad.reshape({-1}));
}

void Executor::addGrad(Param& p, const at::Tensor& gradFlat) { putInBucket(p, gradFlat); }

void Executor::putInBucket(Param& p, const at::Tensor& gradFlat) {
  const at::ScalarType dtype = reduceDtype_.value_or(gradFlat.scalar_type());
  const int ws = rt_.transport_->worldSize();
  const int64_t nextBytes = ws * p.shardNumel_ * int64_t(c10::elementSize(dtype));
  ReduceBucket* bucket = &buckets_->current(dtype, gradFlat.device());
  if (rt_.schedule_->flushBefore(graphId_, bucket->usedBytes(), nextBytes, rt_.config_.reduceBucketBytes)) {
    flush(dtype);
    bucket = &buckets_->current(dtype);
  }
  if (bucket->rankMajor()) {
    bucket->defer(p.id_, p.shardNumel_, gradFlat);
  } else {
    at::Tensor region = bucket->allocate(p.id_, p.shardNumel_);  // [ws, shardNumel]
    // Row r gets elements [r*s, (r+1)*s) of the gradient; the tail past numel is
    // zero, so no collective reads past the gradient.
    const int64_t s = p.shardNumel_;
    const int64_t fullRows = s == 0 ? 0 : p.numel_ / s;
    const int64_t rem = p.numel_ - fullRows * s;
    if (fullRows > 0)
      region.narrow(0, 0, fullRows).copy_(gradFlat.narrow(0, 0, fullRows * s).view({fullRows, s}));
    if (fullRows < ws) {
      at::Tensor row = region.select(0, fullRows);
      if (rem > 0) row.narrow(0, 0, rem).copy_(gradFlat.narrow(0, fullRows * s, rem));
      row.narrow(0, rem, s - rem).zero_();
      if (fullRows + 1 < ws) region.narrow(0, fullRows + 1, ws - fullRows - 1).zero_();
    }
  }
  if (rt_.schedule_->flushAfter(graphId_, p.id_)) flush(dtype);
}

void Executor::flush(at::ScalarType dtype) {
  ReduceBucket& bucket = buckets_->current(dtype);
  if (bucket.empty()) return;
  std::vector<int64_t> ids;
  for (const ReduceTask& task : bucket.tasks()) ids.push_back(task.dsId_);
  rt_.schedule_->onFlush(graphId_, ids, bucket.usedBytes());
  bucket.pending_ = launchReduce(bucket);
  ReduceBucket& next = buckets_->swap(dtype);
  // With double buffering the next bucket's reduction has had a whole bucket's
  // worth of backward to finish; without, this completes the one just launched.
  complete(next);
}

void Executor::complete(ReduceBucket& bucket) {
  if (!bucket.pending_) {
    TORCH_INTERNAL_ASSERT(bucket.empty(), "a filled bucket was not flushed");
    return;
  }
  const double scale = 1.0 / rt_.transport_->worldSize();  // gradients are averaged over ranks
  // Where each reduced slice goes is decided here, on the host; the tensor ops go in one
  // multi-tensor launch per kind (a bucket holds tens of gradients).
  std::vector<at::Tensor> copyTo, copyFrom, scaleOnly;
  // A gradient reduced twice into one bucket (a module called twice) is added to twice: one
  // multi-tensor launch must not write a tensor twice (its chunks run in parallel), so the
  // second addition goes into the next round.
  std::vector<std::vector<at::Tensor>> addTo, addFrom;
  auto addRound = [&](const at::Tensor& target) {
    size_t r = 0;
    while (r < addTo.size() &&
           std::any_of(
               addTo[r].begin(), addTo[r].end(), [&](const at::Tensor& t) { return t.is_same(target); })) {
      ++r;
    }
    if (r == addTo.size()) {
      addTo.emplace_back();
      addFrom.emplace_back();
    }
    return r;
  };
  for (const ReduceTask& task : bucket.tasks()) {
    Param& p = rt_.registry_->get("end_backward", task.dsId_);
    at::Tensor reduced = reducedSlice(bucket, task);
    if (p.grad_.defined() && p.accumulate_) {
      const size_t r = addRound(p.grad_);
      addTo[r].push_back(p.grad_);
      addFrom[r].push_back(reduced);
    } else if (p.grad_.defined()) {
      copyTo.push_back(p.grad_);
      copyFrom.push_back(reduced);
    } else if (sliceIsGradient() && reduced.scalar_type() == p.shard_.scalar_type()) {
      p.grad_ = reduced;  // the reduced memory itself becomes the gradient
      scaleOnly.push_back(reduced);
    } else {
      p.grad_ = at::empty_like(p.shard_);  // on the caller's stream; runAfter orders after it
      copyTo.push_back(p.grad_);
      copyFrom.push_back(reduced);
    }
    p.accumulate_ = true;
  }
  // Queued after the reduction (on its stream on a GPU); end_backward waits for all of them.
  CommHandlePtr accumulated = rt_.transport_->runAfter(bucket.pending_, [&] {
    if (!copyTo.empty()) {
      at::_foreach_copy_(copyTo, copyFrom);
      at::_foreach_mul_(copyTo, scale);
    }
    if (!scaleOnly.empty()) at::_foreach_mul_(scaleOnly, scale);
    for (size_t r = 0; r < addTo.size(); ++r) at::_foreach_add_(addTo[r], addFrom[r], scale);
  });
  bucket.reset();
  // While the reduction or the accumulation (ZeRO-1 reads the all-reduced buffer itself) may
  // still read the buffer (on a GPU), the next fill gets a fresh one; the allocator keeps this
  // memory until their stream is done with it.
  // A rank-major bucket packs a buffer of just its size at every flush.
  if (bucket.rankMajor() || !accumulated->isCompleted()) bucket.releaseMemory();
  accumulations_.push_back(std::move(accumulated));
}

void Executor::startBackward(bool sync) { sync_ = sync; }

void Executor::endBackward() {
  for (ReduceBucket* b : buckets_->all()) {
    if (!b->empty() && !b->pending_) flush(b->dtype());
  }
  drain();
  // Bucket memory is for backward only: the optimizer step and the next forward peak without it.
  for (ReduceBucket* b : buckets_->all()) b->releaseMemory();
}

void Executor::drain() {
  for (ReduceBucket* b : buckets_->all()) complete(*b);
  for (const CommHandlePtr& h : accumulations_) h->wait();
  accumulations_.clear();
}

void Zero1Executor::addGrad(Param& p, const at::Tensor& gradFlat) {
  auto it = localGrad_.find(p.id_);
  if (!sync_) {
    if (it == localGrad_.end()) {
      localGrad_.emplace(p.id_, gradFlat.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true));
    } else {
      it->second.add_(gradFlat);
    }
    return;
  }
  if (it == localGrad_.end()) {
    putInBucket(p, gradFlat);
    return;
  }
  at::Tensor total = std::move(it->second);
  localGrad_.erase(it);
  total.add_(gradFlat);
  putInBucket(p, total);
}

CommHandlePtr Zero1Executor::launchReduce(ReduceBucket& bucket) {
  return rt_.transport_->allReduce(bucket.commInput());
}

at::Tensor Zero1Executor::reducedSlice(ReduceBucket& bucket, const ReduceTask& task) {
  return bucket.region(task).select(0, rt_.transport_->rank());
}

CommHandlePtr ShardedGradExecutor::launchReduce(ReduceBucket& bucket) {
  bucket.pack();
  at::Tensor input = bucket.commInput();
  bucket.output_ = at::empty({input.size(1)}, input.options());
  return rt_.transport_->reduceScatter(bucket.output_, input);
}

at::Tensor ShardedGradExecutor::reducedSlice(ReduceBucket& bucket, const ReduceTask& task) {
  return bucket.output_.narrow(0, task.colOffset_, task.cols_);
}

// ---------------------------------------------------------------- lifecycle API

void init(std::shared_ptr<Transport> transport, const RuntimeConfig& config) {
  std::lock_guard<std::mutex> lock(gMutex);
  TORCH_CHECK(gState == nullptr, "init: the dc runtime is already initialized; call cleanup() first");
  TORCH_CHECK(transport != nullptr, "init: transport should not be null");
  TORCH_CHECK(config.reduceBucketBytes > 0, "init: reduce_bucket_bytes should be > 0, got ",
              config.reduceBucketBytes);
  TORCH_CHECK(config.freeActivationThresholdBytes >= 0,
              "init: free_activation_threshold_bytes should be >= 0, got ",
              config.freeActivationThresholdBytes);
  auto st = std::make_unique<RuntimeState>();
  st->registry_ =
      std::make_unique<ParamRegistry>(transport->worldSize(), *transport, config.maxReleaseLagBytes);
  st->transport_ = std::move(transport);
  st->config_ = config;
  st->schedule_ = std::make_unique<SchedulePolicy>();
  gState = std::move(st);
}

void cleanup() {
  std::lock_guard<std::mutex> lock(gMutex);
  if (!gState) return;
  for (auto& [id, ex] : gState->executors_) ex->drain();
  for (auto& [id, p] : gState->registry_->all()) {
    gState->registry_->dropGathered(p);
    gState->registry_->reload(p);
  }
  gState.reset();
}

bool isInitialized() {
  std::lock_guard<std::mutex> lock(gMutex);
  return gState != nullptr;
}

int worldSize() {
  std::lock_guard<std::mutex> lock(gMutex);
  return state("world_size").transport_->worldSize();
}

int rank() {
  std::lock_guard<std::mutex> lock(gMutex);
  return state("rank").transport_->rank();
}

void registerParam(int64_t dsId, const std::vector<int64_t>& shape, const at::Tensor& shard,
                   const at::Tensor& gradBuffer, bool persistent, bool trainable) {
  std::lock_guard<std::mutex> lock(gMutex);
  state("register_param").registry_->registerParam(dsId, shape, shard, gradBuffer, persistent, trainable);
}

void registerGraph(int64_t graphId, Stage stage, const std::vector<int64_t>& dsIds,
                   std::optional<at::ScalarType> reduceDtype) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("register_graph");
  TORCH_CHECK(!rt.executors_.count(graphId), "register_graph: graph_id ", graphId, " is already registered");
  std::unique_ptr<Executor> ex;
  if (stage == Stage::Zero1) {
    ex = std::make_unique<Zero1Executor>(graphId, stage, dsIds, reduceDtype, rt);
  } else {
    TORCH_CHECK(stage == Stage::Zero2 || stage == Stage::Zero3,
                "register_graph: stage should be 1, 2 or 3, got ", static_cast<int>(stage));
    ex = std::make_unique<ShardedGradExecutor>(graphId, stage, dsIds, reduceDtype, rt);
  }
  rt.executors_.emplace(graphId, std::move(ex));
}

void setPersistent(int64_t dsId, bool persistent) {
  std::lock_guard<std::mutex> lock(gMutex);
  state("set_persistent").registry_->get("set_persistent", dsId).persistent_ = persistent;
}

void startForward() {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("start_forward");
  // Use counts of an interrupted step must not leak into this one.
  for (auto& [id, p] : rt.registry_->all()) p.uses_ = 0;
  // The optimizer wrote the shards before this point; this step's gathers wait for no more.
  rt.transport_->shardsWritten();
  rt.schedule_->onGraphStart(-1);
  rt.schedule_->onStartForward();
  if (rt.observer_) rt.observer_->onStartForward();
}

void endForward() {
  std::lock_guard<std::mutex> lock(gMutex);
  state("end_forward").schedule_->onGraphEnd(-1);
}

void startBackward(bool update, bool sync) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("start_backward");
  // Per parameter, once (the forward and backward executors hold the same parameters).
  for (auto& [id, p] : rt.registry_->all()) p.accumulate_ = !update && p.grad_.defined();
  for (auto& [id, ex] : rt.executors_) ex->startBackward(sync);
  rt.schedule_->onStartBackward(update, sync);
  if (rt.observer_) rt.observer_->onStartBackward(update, sync);
}

void setGrads(const std::vector<int64_t>& dsIds, const std::vector<at::Tensor>& grads) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("set_grads");
  TORCH_CHECK(dsIds.size() == grads.size(), "set_grads: ds_ids and grads should have the same length, got ",
              dsIds.size(), " and ", grads.size());
  for (size_t i = 0; i < dsIds.size(); ++i) {
    Param& p = callerGradParam(rt, "set_grads", dsIds[i]);
    const at::Tensor& g = grads[i];
    if (g.defined()) {
      TORCH_CHECK(g.dim() == 1 && g.numel() == p.shardNumel_ && g.device() == p.shard_.device() &&
                      at::isFloatingType(g.scalar_type()),
                  "set_grads: grads[", i, "] (ds_id ", dsIds[i], ") should be a 1-D floating tensor of ",
                  p.shardNumel_, " elements on ", p.shard_.device(), ", got ", g.sizes(), " ",
                  g.scalar_type(), " on ", g.device());
    }
    p.grad_ = g;
  }
}

std::vector<at::Tensor> takeGrads(const std::vector<int64_t>& dsIds) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("take_grads");
  std::vector<at::Tensor> out;
  out.reserve(dsIds.size());
  for (int64_t id : dsIds)
    out.push_back(std::exchange(callerGradParam(rt, "take_grads", id).grad_, at::Tensor()));
  return out;
}

void reset() {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("reset");
  for (auto& [id, ex] : rt.executors_) ex->drain();
  rt.executors_.clear();
}

void enableProfiling(bool enable) {
  std::lock_guard<std::mutex> lock(gMutex);
  state("enable_profiling").profiling_ = enable;
}

bool isProfiling() {
  std::lock_guard<std::mutex> lock(gMutex);
  return gState != nullptr && gState->profiling_;
}

void invalidateGatheredParam(int64_t dsId) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("invalidate_gathered_param");
  rt.registry_->dropGathered(rt.registry_->get("invalidate_gathered_param", dsId));
}

void clearAllGatheredParams() {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("clear_all_gathered_params");
  for (auto& [id, p] : rt.registry_->all()) rt.registry_->dropGathered(p);
}

std::vector<int64_t> gatheredParamIds() {
  std::lock_guard<std::mutex> lock(gMutex);
  std::vector<int64_t> ids;
  for (auto& [id, p] : state("gathered_param_ids").registry_->all()) {
    if (p.hasGathered()) ids.push_back(id);
  }
  return ids;
}

void setObserver(std::shared_ptr<OpObserver> observer) {
  std::lock_guard<std::mutex> lock(gMutex);
  state("set_observer").observer_ = std::move(observer);
}

void setSchedule(std::unique_ptr<SchedulePolicy> schedule) {
  std::lock_guard<std::mutex> lock(gMutex);
  TORCH_CHECK(schedule != nullptr, "set_schedule: schedule should not be null");
  state("set_schedule").schedule_ = std::move(schedule);
}

void withSchedule(const std::function<void(SchedulePolicy&)>& fn) {
  std::lock_guard<std::mutex> lock(gMutex);
  fn(*state("schedule").schedule_);
}

std::vector<int64_t> paramShape(const char* op, int64_t dsId) {
  std::lock_guard<std::mutex> lock(gMutex);
  return state(op).registry_->get(op, dsId).shape_;
}

// ---------------------------------------------------------------- op entry points

at::Tensor allgatherParam(const at::Tensor& shard, int64_t graphId, int64_t dsId,
                          std::optional<at::ScalarType> dtype) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("allgather_param");
  Executor& ex = executor("allgather_param", graphId);
  Param& p = ex.param("allgather_param", dsId);
  const at::ScalarType t = dtype.value_or(p.shard_.scalar_type());
  scheduleBefore(rt,
                 OpEvent{"allgather_param", graphId, dsId, gatherBytes(p, t, rt.transport_->worldSize()), t});
  reportGathers(rt, ex, graphId, {dsId}, {t}, /*planned=*/false);
  ObserverScope scope(
      rt, OpEvent{"allgather_param", graphId, dsId, gatherBytes(p, t, rt.transport_->worldSize()), t});
  return ex.allgatherParam(shard, dsId, dtype);
}

void prefetchParamsFused(int64_t graphId, const std::vector<at::Tensor>& shards,
                         const std::vector<int64_t>& dsIds,
                         const std::optional<std::vector<at::ScalarType>>& dtypes) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("prefetch_params_fused");
  Executor& ex = executor("prefetch_params_fused", graphId);
  TORCH_CHECK(shards.size() == dsIds.size(),
              "prefetch_params_fused: params and ids should have the same length, got ", shards.size(),
              " and ", dsIds.size());
  TORCH_CHECK(!dtypes || dtypes->size() == dsIds.size(),
              "prefetch_params_fused: dtypes should have one entry per id (", dsIds.size(), "), got ",
              dtypes ? dtypes->size() : 0);
  scheduleBefore(rt, OpEvent{"prefetch_params_fused", graphId, -1, 0, at::ScalarType::Undefined});
  std::vector<at::ScalarType> types;
  int64_t bytes = 0;
  for (size_t i = 0; i < dsIds.size(); ++i) {
    Param& p = ex.param("prefetch_params_fused", dsIds[i]);
    TORCH_CHECK(shards[i].numel() == p.shardNumel_ || p.offloaded_, "prefetch_params_fused: ds_id ", dsIds[i],
                ": params[", i, "] should be the registered shard of ", p.shardNumel_, " elements, got ",
                shards[i].numel());
    types.push_back(dtypes ? (*dtypes)[i] : p.shard_.scalar_type());
    bytes += gatherBytes(p, types.back(), rt.transport_->worldSize());
  }
  reportGathers(rt, ex, graphId, dsIds, types, /*planned=*/false);
  ObserverScope scope(rt, OpEvent{"prefetch_params_fused", graphId, -1, bytes,
                                  types.empty() ? at::ScalarType::Undefined : types.front(), dsIds});
  ex.prefetchParamsFused(dsIds, types);
}

at::Tensor waitAllgather(const at::Tensor& gathered, int64_t graphId, int64_t dsId) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("wait_allgather");
  Executor& ex = executor("wait_allgather", graphId);
  scheduleBefore(rt, OpEvent{"wait_allgather", graphId, dsId, 0, gathered.scalar_type()});
  ObserverScope scope(
      rt, OpEvent{"wait_allgather", graphId, dsId, tensorBytes(gathered), gathered.scalar_type()});
  return ex.waitAllgather(gathered, dsId);
}

at::Tensor releaseParam(const at::Tensor& token, int64_t graphId, int64_t dsId, int64_t nUsers) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("release_param");
  Executor& ex = executor("release_param", graphId);
  scheduleBefore(rt, OpEvent{"release_param", graphId, dsId, 0, token.scalar_type()});
  ObserverScope scope(rt, OpEvent{"release_param", graphId, dsId, 0, token.scalar_type(), {}, nUsers});
  ex.releaseParam(dsId, nUsers);
  return token;
}

at::Tensor reduceGrad(const at::Tensor& grad, int64_t graphId, int64_t dsId) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("reduce_grad");
  Executor& ex = executor("reduce_grad", graphId);
  scheduleBefore(rt, OpEvent{"reduce_grad", graphId, dsId, tensorBytes(grad), grad.scalar_type()});
  ObserverScope scope(rt, OpEvent{"reduce_grad", graphId, dsId, tensorBytes(grad), grad.scalar_type()});
  ex.reduceGrad(grad, dsId);
  // The reduced gradient lands in the registered grad buffer; the op's result
  // is an empty token that keeps the graph ordered.
  return at::empty({0}, grad.options());
}

void endBackward(int64_t graphId) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("end_backward");
  Executor& ex = executor("end_backward", graphId);
  scheduleBefore(rt, OpEvent{"end_backward", graphId, -1, 0, at::ScalarType::Undefined});
  ObserverScope scope(rt, OpEvent{"end_backward", graphId, -1, 0, at::ScalarType::Undefined});
  ex.endBackward();
  rt.schedule_->onGraphEnd(graphId);
}

void freeTensors(const std::vector<at::Tensor>& tensors) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("free_tensors");
  int64_t freed = 0;
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || !t.has_storage()) continue;
    const int64_t bytes = static_cast<int64_t>(t.storage().nbytes());
    if (bytes == 0 || bytes < rt.config_.freeActivationThresholdBytes) continue;
    freeStorage(t);
    freed += bytes;
  }
  ObserverScope scope(rt, OpEvent{"free_tensors", -1, -1, freed, at::ScalarType::Undefined});
}

at::Tensor offloadTensor(const at::Tensor& tensor, int64_t graphId, int64_t id) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("offload_tensor");
  scheduleBefore(rt, OpEvent{"offload_tensor", graphId, id, 0, at::ScalarType::Undefined});
  ObserverScope scope(rt, OpEvent{"offload_tensor", graphId, id, tensorBytes(tensor), tensor.scalar_type()});
  // A device tensor goes to pinned host memory; reload_tensor brings it back
  // to the device it came from, remembered here.
  const bool onHost = tensor.device().is_cpu();
  at::Tensor host = at::empty_like(tensor, tensor.options().device(at::kCPU).pinned_memory(!onHost));
  const auto key = std::make_pair(graphId, id);
  if (onHost) {
    host.copy_(tensor);
  } else {
    // The transport copies on its offload stream; wait_offload waits for it.
    rt.offloadCopies_.insert_or_assign(key,
                                       rt.transport_->copyAsync(host, tensor, Transport::CopyKind::Offload));
  }
  rt.offloadedFrom_.insert_or_assign(key, tensor.device());
  return host;
}

at::Tensor reloadTensor(const at::Tensor& tensor, int64_t graphId, int64_t id) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("reload_tensor");
  scheduleBefore(rt, OpEvent{"reload_tensor", graphId, id, 0, at::ScalarType::Undefined});
  ObserverScope scope(rt, OpEvent{"reload_tensor", graphId, id, tensorBytes(tensor), tensor.scalar_type()});
  const auto key = std::make_pair(graphId, id);
  auto it = rt.offloadedFrom_.find(key);
  const c10::Device device = it != rt.offloadedFrom_.end() ? it->second : tensor.device();
  if (auto pending = rt.offloadCopies_.find(key); pending != rt.offloadCopies_.end()) {
    pending->second->wait();  // the host copy must be complete before it is read back
    rt.offloadCopies_.erase(pending);
  }
  if (device.is_cpu() || !tensor.device().is_cpu() || !tensor.is_pinned()) {
    return tensor.to(device, /*non_blocking=*/false, /*copy=*/true);
  }
  // From pinned memory the transport copies on its reload stream; wait_reload waits for it.
  at::Tensor out = at::empty_like(tensor, tensor.options().device(device).pinned_memory(false));
  rt.reloadCopies_.insert_or_assign(key, rt.transport_->copyAsync(out, tensor, Transport::CopyKind::Reload));
  return out;
}

at::Tensor waitOffload(const at::Tensor& tensor, int64_t graphId, int64_t id) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("wait_offload");
  scheduleBefore(rt, OpEvent{"wait_offload", graphId, id, 0, at::ScalarType::Undefined});
  ObserverScope scope(rt, OpEvent{"wait_offload", graphId, id, tensorBytes(tensor), tensor.scalar_type()});
  if (auto pending = rt.offloadCopies_.find({graphId, id}); pending != rt.offloadCopies_.end()) {
    pending->second->wait();
    rt.offloadCopies_.erase(pending);
  }
  // The schema promises a fresh tensor.
  return tensor.clone();
}

at::Tensor waitReload(const at::Tensor& tensor, int64_t graphId, int64_t id) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("wait_reload");
  scheduleBefore(rt, OpEvent{"wait_reload", graphId, id, 0, at::ScalarType::Undefined});
  ObserverScope scope(rt, OpEvent{"wait_reload", graphId, id, tensorBytes(tensor), tensor.scalar_type()});
  if (auto pending = rt.reloadCopies_.find({graphId, id}); pending != rt.reloadCopies_.end()) {
    pending->second->wait();  // the caller's stream waits for the reload stream
    rt.reloadCopies_.erase(pending);
  }
  return tensor.clone();
}

namespace {

// offload_parameter and reload_parameter differ only in the registry call they make.
template <typename Move>
void moveParameter(const char* op, int64_t graphId, int64_t dsId, Move&& move) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state(op);
  Executor& ex = executor(op, graphId);
  scheduleBefore(rt, OpEvent{op, graphId, dsId, 0, at::ScalarType::Undefined});
  Param& p = ex.param(op, dsId);
  ObserverScope scope(rt, OpEvent{op, graphId, dsId, tensorBytes(p.shard_), p.shard_.scalar_type()});
  move(*rt.registry_, p);
}

}  // namespace

void offloadParameter(const at::Tensor& token, int64_t graphId, int64_t dsId) {
  moveParameter("offload_parameter", graphId, dsId, [](auto& registry, Param& p) { registry.offload(p); });
}

void reloadParameter(const at::Tensor& token, int64_t graphId, int64_t dsId) {
  moveParameter("reload_parameter", graphId, dsId, [](auto& registry, Param& p) { registry.reload(p); });
}

namespace {

std::optional<shm::DType> shmDType(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return shm::DType::Float32;
    case at::kBFloat16: return shm::DType::BFloat16;
    case at::kHalf: return shm::DType::Float16;
    default: return std::nullopt;
  }
}

}  // namespace

void allReduceInPlace(const char* op, const at::Tensor& tensor) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state(op);
  ObserverScope scope(rt, OpEvent{op, -1, -1, tensorBytes(tensor), tensor.scalar_type()});
  at::Tensor flat = tensor.is_contiguous() ? tensor : tensor.contiguous();
  const std::optional<shm::DType> type = shmDType(tensor.scalar_type());
  if (rt.localAllReduce_ && type && tensor.is_cpu()) {
    try {
      rt.localAllReduce_->allReduce(op, flat.data_ptr(), static_cast<size_t>(flat.numel()), *type);
    } catch (const shm::Error& e) {
      TORCH_CHECK(false, e.what());
    }
  } else {
    rt.transport_->allReduce(flat)->wait();
  }
  if (!flat.is_same(tensor)) tensor.copy_(flat);
}

void setLocalAllReduce(std::unique_ptr<shm::ShmComm> comm) {
  std::lock_guard<std::mutex> lock(gMutex);
  state("set_local_all_reduce").localAllReduce_ = std::move(comm);
}

std::string localAllReducePath() {
  std::lock_guard<std::mutex> lock(gMutex);
  const auto& local = state("local_all_reduce_path").localAllReduce_;
  return local ? local->path() : "";
}

}  // namespace dcplan::replayer
