// The process-wide runtime: its state, lifecycle, registration and settings (Runtime.h).
#include "RuntimeState.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <functional>
#include <utility>

namespace dcplan::replayer {

std::mutex gMutex;

namespace {

std::unique_ptr<RuntimeState> gState;

/// Parameter dsId, which must be trainable without a registered gradient buffer (its
/// gradient is the caller's to give and take).
Param& callerGradParam(RuntimeState& rt, const char* op, int64_t dsId) {
  Param& p = rt.registry_->get(op, dsId);
  TORCH_CHECK(p.trainable_ && !p.fixedGrad_, op, ": ", p.label(),
              p.trainable_ ? " has a registered grad_buffer" : " is frozen (registered as not trainable)");
  return p;
}

/// A captured step's graph replays the steps and no capture is under way: only eval forwards run.
bool besideCapturedGraph(const RuntimeState& rt) { return rt.captured_ && !rt.capturing_; }

}  // namespace

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
  if (config.checkCollectives) {
    const RuntimeState* raw = st.get();  // owns the transport, so outlives it
    transport = makeCheckedTransport(std::move(transport), [raw] { return raw->place_; });
  }
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
  // After a failed collective the pending ones fail too: the runtime is dropped all the same
  // (an exit handler must not raise for what the job already reported).
  try {
    for (auto& [id, ex] : gState->executors_) ex->drain();
    for (auto& [id, p] : gState->registry_->all()) {
      gState->registry_->dropGathered(p);
      gState->registry_->reload(p);
    }
  } catch (const std::exception&) {
    if (gState->failure_.empty()) {
      gState.reset();
      throw;
    }
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
                   const at::Tensor& gradBuffer, bool persistent, bool trainable, const std::string& name) {
  std::lock_guard<std::mutex> lock(gMutex);
  state("register_param")
      .registry_->registerParam(dsId, shape, shard, gradBuffer, persistent, trainable, name);
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

void startForward(bool training) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("start_forward");
  const bool besideGraph = besideCapturedGraph(rt);
  TORCH_CHECK(
      !besideGraph || !training,
      "start_forward: this model's training step is captured in a CUDA graph (dcplan.graphed_step), which "
      "replays it; a training forward outside it would find the runtime's state as the capture left it. "
      "Between replays only forwards without grad may run (an eval forward, generate()); call close() on "
      "the graphed step first to train outside it");
  if (besideGraph) {
    // An eval forward between replays: the graph keeps the copies it replays with (held until
    // release_capture, whichever pool they came from); the eval gathers its own and drops them at
    // its end.
    std::vector<at::Tensor> held = rt.registry_->forgetGatheredOfGraph();
    rt.heldForGraph_.insert(rt.heldForGraph_.end(), held.begin(), held.end());
  }
  ++rt.step_;
  rt.inBackward_ = false;
  rt.opInPass_ = 0;
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
  auto& rt = state("end_forward");
  rt.schedule_->onGraphEnd(-1);
  if (besideCapturedGraph(rt)) {
    // An eval forward between replays keeps nothing gathered: the graph's step holds its budget.
    rt.registry_->dropAllGathered();
  }
}

void startBackward(bool update, bool sync) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("start_backward");
  rt.inBackward_ = true;
  rt.opInPass_ = 0;
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
                  "set_grads: grads[", i, "] for ", p.label(), " should be a 1-D floating tensor of ",
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

namespace {

/// fn on each registered parameter of dsIds, under the runtime's lock.
template <typename Fn>
void forEachParam(const char* op, const std::vector<int64_t>& dsIds, Fn&& fn) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state(op);
  for (int64_t id : dsIds) fn(*rt.registry_, rt.registry_->get(op, id));
}

}  // namespace

void setMastersOnHost(const std::vector<int64_t>& dsIds) {
  forEachParam("set_masters_on_host", dsIds, [](ParamRegistry& registry, Param& p) {
    TORCH_CHECK(!p.hasGathered(), "set_masters_on_host: ", p.label(),
                " holds a gathered copy; a plan's master ", "offload starts before the first step");
    p.masterOnHost_ = true;
    registry.offload(p);
  });
}

void reloadMasters(const std::vector<int64_t>& dsIds) {
  forEachParam("reload_masters", dsIds, [](ParamRegistry& registry, Param& p) { registry.reload(p); });
}

void offloadMasters(const std::vector<int64_t>& dsIds) {
  forEachParam("offload_masters", dsIds, [](ParamRegistry& registry, Param& p) {
    TORCH_CHECK(p.masterOnHost_, "offload_masters: ", p.label(),
                " is not a master the plan keeps on the host");
    registry.offload(p);
  });
}

at::Tensor masterHost(int64_t dsId) {
  at::Tensor host;
  forEachParam("master_host", {dsId}, [&](ParamRegistry&, Param& p) {
    TORCH_CHECK(p.masterOnHost_, "master_host: ", p.label(), " is not a master the plan keeps on the host");
    TORCH_CHECK(p.offloaded_, "master_host: ", p.label(), "'s master shard is on the device (inside a step)");
    host = p.host_;
  });
  return host;
}

void clearAllGatheredParams() {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("clear_all_gathered_params");
  rt.registry_->dropAllGathered();
}

std::vector<int64_t> gatheredParamIds() {
  std::lock_guard<std::mutex> lock(gMutex);
  std::vector<int64_t> ids;
  for (auto& [id, p] : state("gathered_param_ids").registry_->all()) {
    if (p.hasGathered()) ids.push_back(id);
  }
  return ids;
}

void beginCapture() {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("begin_capture");
  TORCH_CHECK(!rt.capturing_, "begin_capture: a capture is already under way");
  TORCH_CHECK(rt.failure_.empty(), "begin_capture: a collective failed earlier: ", rt.failure_);
  TORCH_CHECK(
      !rt.observer_,
      "begin_capture: an op observer is set (dcplan record or the op log); "
      "they measure each op on the host, and a replayed graph runs no op there: record or log without "
      "dcplan.graphed_step");
  TORCH_CHECK(
      !rt.config_.checkCollectives,
      "begin_capture: check_collectives waits on the host for every "
      "collective, which a CUDA graph cannot capture; turn it off (DCPLAN_CHECK_COLLECTIVES) to capture");
  // The caller synchronized the device: every release tracked so far is complete.
  rt.registry_->forgetReleases();
  rt.transport_->beginCapture();
  rt.capturing_ = true;
  rt.captured_ = true;
}

void endCapture() {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("end_capture");
  TORCH_CHECK(rt.capturing_, "end_capture: no capture under way (begin_capture first)");
  rt.capturing_ = false;
  rt.transport_->endCapture();
}

void releaseCapture() {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("release_capture");
  TORCH_CHECK(!rt.capturing_, "release_capture: a capture is under way (end_capture first)");
  if (!rt.captured_) return;
  rt.captured_ = false;
  rt.registry_->dropAllGathered();
  rt.heldForGraph_.clear();  // the caller synchronized and drops the graph
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

}  // namespace dcplan::replayer
