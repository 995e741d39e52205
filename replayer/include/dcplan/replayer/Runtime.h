// Public API of the dc runtime: lifecycle, registration, and the op entry points the kernels call.
#pragma once

#include "dcplan/replayer/OpObserver.h"
#include "dcplan/replayer/Schedule.h"
#include "dcplan/replayer/Transport.h"
#include "dcplan/schemas/plan.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dcplan::shm {
class ShmComm;
}

namespace dcplan::replayer {

/// Runtime options. Every size is in bytes.
struct RuntimeConfig {
  /// A reduce bucket is flushed when adding a gradient would take it past this size.
  int64_t reduceBucketBytes = schemas::kDefaultBucketBytes;
  /// Two buckets per dtype, so one fills while the other is being reduced.
  bool doubleBuffer = true;
  /// free_tensors frees only tensors at least this large.
  int64_t freeActivationThresholdBytes = 1024 * 1024;
  /// Gathered copies released by the host but not yet used up by the device (a GPU runs
  /// behind the host) may hold at most this much memory: a gather waits (on the host) for
  /// the oldest releases beyond it. Keeps the peak memory what the planner predicts.
  int64_t maxReleaseLagBytes = 512ll << 20;
  /// Before each collective the ranks agree on what it is (one small all-gather each), so that
  /// ranks whose op sequences diverge fail with an error naming both ops rather than launch
  /// collectives of different sizes (CollectiveCheck.h).
  bool checkCollectives = false;
};

enum class Stage : int { Zero1 = 1, Zero2 = 2, Zero3 = 3 };

/// Starts the runtime on a transport. Fails when already initialized.
void init(std::shared_ptr<Transport> transport, const RuntimeConfig& config);
/// Waits for pending collectives and drops every executor, parameter and buffer.
void cleanup();
bool isInitialized();
int worldSize();
int rank();

/// Registers parameter dsId. shard is this rank's flat slice of
/// ceil(numel/worldSize) elements (zero padded past numel); gradBuffer has the
/// same size and receives the reduced gradient (undefined for a frozen
/// parameter). The caller keeps both alive. trainable without a gradBuffer: the
/// gradient is the caller's to give (setGrads) and take (takeGrads) each backward,
/// and the first reduction of a backward into none creates it.
/// name: the parameter's qualified name, which error messages give beside its ds_id.
void registerParam(int64_t dsId, const std::vector<int64_t>& shape, const at::Tensor& shard,
                   const at::Tensor& gradBuffer, bool persistent, bool trainable = false,
                   const std::string& name = "");
/// Before a backward: the gradients its reductions add to (undefined: none yet), for
/// parameters registered trainable without a gradient buffer.
void setGrads(const std::vector<int64_t>& dsIds, const std::vector<at::Tensor>& grads);
/// After end_backward: those parameters' gradients (undefined: none), which the runtime
/// then forgets, so that their memory is the caller's alone.
std::vector<at::Tensor> takeGrads(const std::vector<int64_t>& dsIds);
/// Registers graph graphId run by a stage executor over the given parameters.
/// reduceDtype: dtype of the reduce buckets (default: the gradient's dtype).
void registerGraph(int64_t graphId, Stage stage, const std::vector<int64_t>& dsIds,
                   std::optional<at::ScalarType> reduceDtype = std::nullopt);

void setPersistent(int64_t dsId, bool persistent);
/// training: the forward runs with grad (a micro-step). While a step is captured
/// (dcplan.graphed_step) only a forward without grad may run beside its graph.
void startForward(bool training = true);
/// Ends a forward; one beside a captured step's graph drops what it gathered.
void endForward();
/// update: the gradients start from zero (the optimizer consumed them);
/// sync: this micro-step ends gradient accumulation (ZeRO-1 reduces only then).
void startBackward(bool update, bool sync);
/// Drops the executors (parameters stay registered).
void reset();
void enableProfiling(bool enable);
bool isProfiling();
void invalidateGatheredParam(int64_t dsId);
void clearAllGatheredParams();
/// Ids currently holding a gathered copy (valid or in flight), ascending.
std::vector<int64_t> gatheredParamIds();

/// A plan's master offload (docs/planning.md, "Offload"): from now on the shards of dsIds live on
/// the host (copied there now), brought back for each gather and dropped once it is done.
void setMastersOnHost(const std::vector<int64_t>& dsIds);
/// Brings the shards of dsIds back from the host, where they are there (their update, a state
/// dict); offloadMasters copies them out and frees them on the device again.
void reloadMasters(const std::vector<int64_t>& dsIds);
void offloadMasters(const std::vector<int64_t>& dsIds);
/// The host copy of dsId's master shard, which a plan keeps on the host and which is there now
/// (between steps): state dicts read and write it in place.
at::Tensor masterHost(int64_t dsId);

/// CUDA graph capture of whole steps (python/dcplan/_graphed.py). beginCapture, once the
/// caller's stream captures and the device has finished all earlier work: the transport's
/// streams join the capture. endCapture, before the capture ends. From beginCapture on, the
/// graph replays the steps: an eager step is refused until releaseCapture, which also drops
/// the gathered copies the capture left (they live in the graph's memory).
void beginCapture();
void endCapture();
void releaseCapture();

void setObserver(std::shared_ptr<OpObserver> observer);
void setSchedule(std::unique_ptr<SchedulePolicy> schedule);
/// Calls fn with the schedule in use, under the runtime's lock (fn must not call the runtime).
void withSchedule(const std::function<void(SchedulePolicy&)>& fn);

/// Shape of parameter dsId, for the Meta kernels.
std::vector<int64_t> paramShape(const char* op, int64_t dsId);

// Op entry points: the device kernels forward here.
at::Tensor allgatherParam(const at::Tensor& shard, int64_t graphId, int64_t dsId,
                          std::optional<at::ScalarType> dtype);
void prefetchParamsFused(int64_t graphId, const std::vector<at::Tensor>& shards,
                         const std::vector<int64_t>& dsIds,
                         const std::optional<std::vector<at::ScalarType>>& dtypes);
at::Tensor waitAllgather(const at::Tensor& gathered, int64_t graphId, int64_t dsId);
at::Tensor releaseParam(const at::Tensor& token, int64_t graphId, int64_t dsId, int64_t nUsers);
at::Tensor reduceGrad(const at::Tensor& grad, int64_t graphId, int64_t dsId);
void endBackward(int64_t graphId);
void freeTensors(const std::vector<at::Tensor>& tensors);
at::Tensor offloadTensor(const at::Tensor& tensor, int64_t graphId, int64_t id);
at::Tensor reloadTensor(const at::Tensor& tensor, int64_t graphId, int64_t id);
at::Tensor waitOffload(const at::Tensor& tensor, int64_t graphId, int64_t id);
at::Tensor waitReload(const at::Tensor& tensor, int64_t graphId, int64_t id);
void offloadParameter(const at::Tensor& token, int64_t graphId, int64_t dsId);
void reloadParameter(const at::Tensor& token, int64_t graphId, int64_t dsId);
/// Sum all-reduce of tensor in place: through the shared-memory communicator for float32,
/// bfloat16 and float16 when one is set, else over the runtime's transport.
void allReduceInPlace(const char* op, const at::Tensor& tensor);
/// Every rank's flat tensor, concatenated in rank order (world_size * numel elements): a
/// collective over the runtime's transport. Its tensors are C++-owned, so that no Gloo worker
/// ever holds a Python tensor (dropping one needs the GIL, which aborts at interpreter exit). On
/// a GPU the caller's stream waits for it and the host does not (it captures in a CUDA graph);
/// on CPU ranks the host waits.
at::Tensor allGatherFlat(const char* op, const at::Tensor& flat);
/// Runs fn with the runtime's transport, under the runtime's lock: for collectives of the tools
/// beside training (the network measurement), which every rank then calls alike.
void withTransport(const char* op, const std::function<void(Transport&)>& fn);
/// The shared-memory communicator of the ranks of this machine (LocalAllReduce.h), used by
/// allReduceInPlace until cleanup(); null: none.
void setLocalAllReduce(std::unique_ptr<shm::ShmComm> comm);
/// The segment the runtime's shared-memory all-reduce uses ("" when it has none).
std::string localAllReducePath();

}  // namespace dcplan::replayer
