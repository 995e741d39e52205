// The collective-communication seam of the runtime: executors talk to a Transport only.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace dcplan::replayer {

/// A launched collective. wait() makes its results visible to the caller's
/// subsequent work: on CPU (Gloo) it blocks the host; a device transport may
/// instead make the current stream wait, so that nothing blocks the host.
class CommHandle {
 public:
  virtual ~CommHandle() = default;
  virtual void wait() = 0;
  /// Whether wait() would return without blocking.
  virtual bool isCompleted() = 0;
  /// Blocks the host until the work is done (a device transport's wait() does not).
  virtual void synchronize() { wait(); }
};

using CommHandlePtr = std::shared_ptr<CommHandle>;

/// A handle with nothing to wait for: its work, if any, was queued on the caller's stream.
CommHandlePtr doneHandle();

/// Whether a reduce-scatter of input into output is one rank's in place (output is input's only
/// row): the identity, which a transport returns at once as doneHandle().
bool reducesAloneInPlace(const at::Tensor& output, const at::Tensor& input);

/// What a failed collective says, for a user's error: a c10::Error's message without its C++
/// backtrace, any other exception's what().
std::string failureMessage(const std::exception& e);

/// The four collectives the executors need. Every tensor is dense and
/// contiguous unless a parameter says otherwise; sizes are in elements.
/// Implementations: ProcessGroupTransport (c10d, any backend; Gloo on CPU) and
/// NcclTransport (replayer/src/cuda/, CUDA builds).
class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int worldSize() const = 0;
  virtual std::string backendName() const = 0;

  /// output[r*n:(r+1)*n] = input of rank r, where n = input.numel() and
  /// output.numel() == worldSize()*n.
  virtual CommHandlePtr allGather(const at::Tensor& output, const at::Tensor& input) = 0;
  /// allGather of several (output, input) pairs as one group call; the pairs
  /// may differ in size and dtype.
  virtual CommHandlePtr allGatherCoalesced(const std::vector<at::Tensor>& outputs,
                                           const std::vector<at::Tensor>& inputs) = 0;
  /// Sum-reduce-scatter: output (n elements) = sum over ranks of input[rank()],
  /// where input is a 2-D [worldSize(), n] tensor whose rows are each
  /// contiguous (the tensor as a whole need not be). One rank's in place
  /// (reducesAloneInPlace) is done at once.
  virtual CommHandlePtr reduceScatter(const at::Tensor& output, const at::Tensor& input) = 0;
  /// In-place sum all-reduce of a contiguous tensor.
  virtual CommHandlePtr allReduce(const at::Tensor& tensor) = 0;

  /// Gathers of registered shards into buffers from newGatherBuffer(), as one group call:
  /// outputs[i] (worldSize() * shards[i].numel() elements) gets every rank's shards[i],
  /// converted to outputs[i]'s dtype. A shard is written only between steps (by the
  /// optimizer), so the gather need not wait for all the caller's queued work: a device
  /// transport waits for the last shardsWritten() point and converts on its own stream. The
  /// default converts on the caller's side and calls allGather / allGatherCoalesced.
  virtual CommHandlePtr gatherShards(const std::vector<at::Tensor>& outputs,
                                     const std::vector<at::Tensor>& shards);
  /// An output buffer for gatherShards (a device transport allocates it on its gather stream).
  virtual at::Tensor newGatherBuffer(int64_t numel, const at::TensorOptions& options);
  /// The caller's work queued so far may have written shards (an optimizer step, a reload):
  /// later gathers wait for it. The default does nothing (its gathers wait for everything).
  virtual void shardsWritten() {}
  /// shard <- host, for a shard kept on the host that a gather is about to read: later gathers
  /// wait for the copy, the caller's later work does not. The default copies on the caller's side
  /// and calls shardsWritten(); a device transport copies on its reload stream once the caller's
  /// work queued so far has run (the shard's new block was last used by it), so that the copy
  /// overlaps the caller's work queued after it.
  virtual void reloadShard(const at::Tensor& shard, const at::Tensor& host);

  /// The caller's work queued so far, as a handle: isCompleted() once it has run. The
  /// default (a host transport, whose work has run when queued) is completed.
  virtual CommHandlePtr markCaller();

  /// Runs `work` (which queues tensor ops) ordered after the collective of `done` and after
  /// the caller's work queued so far (so it may write tensors the caller just allocated),
  /// without making the caller's stream wait for it: a device transport runs it on that
  /// collective's stream. The default waits for done and runs work. The result's wait()
  /// makes work's writes visible to the caller.
  virtual CommHandlePtr runAfter(const CommHandlePtr& done, const std::function<void()>& work);

  /// Direction of a copy between device and host memory.
  enum class CopyKind { Offload, Reload };
  /// Starts dst.copy_(src) (same shape and dtype; Offload: into host memory, Reload: into
  /// device memory). wait() of the result makes dst readable by the caller: a host
  /// destination by the host, a device one by the caller's stream. The default copies
  /// synchronously; a device transport copies on its offload / reload stream.
  virtual CommHandlePtr copyAsync(const at::Tensor& dst, const at::Tensor& src, CopyKind kind);

  /// CUDA graph capture of the caller's stream (dcplan.graphed_step, docs/compiled.md).
  /// beginCapture, once the caller's stream captures: the transport's own streams join the
  /// capture, so that their collectives, and the buffers allocated on them, belong to the graph.
  /// endCapture, before the capture ends: the caller's stream waits for them (a capture must
  /// end on every stream it forked to). In between, handles never report completion and
  /// nothing may block the host. The default refuses: a host transport has nothing to capture.
  virtual void beginCapture();
  virtual void endCapture() {}
  virtual bool capturing() const { return false; }
};

/// A Transport over a c10d ProcessGroup, looked up by its registered group
/// name (Python: `group.group_name`). Defined in ProcessGroupTransport.cpp.
std::shared_ptr<Transport> makeProcessGroupTransport(const std::string& groupName);

/// Whether this build has the CUDA/NCCL transport (built with DCPLAN_WITH_CUDA).
bool hasNcclTransport();
/// A fresh NCCL unique id (128 raw bytes), made by one rank and sent to the others.
std::string makeNcclUniqueId();
/// A Transport on its own NCCL communicator and dedicated CUDA streams of device
/// deviceIndex; uniqueId comes from makeNcclUniqueId() on one rank. Collective: every rank of
/// the communicator calls it. A collective that has not completed after timeout aborts the
/// communicator (a watchdog thread), and every later launch fails naming why. Fails in a
/// build without CUDA.
std::shared_ptr<Transport> makeNcclTransport(const std::string& uniqueId, int rank, int worldSize,
                                             int deviceIndex,
                                             std::chrono::milliseconds timeout = std::chrono::minutes(10));

}  // namespace dcplan::replayer
