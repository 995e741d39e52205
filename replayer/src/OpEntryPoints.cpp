// The op entry points the device kernels forward to: each takes the runtime's lock, gives the
// schedule its turn, tells the observer, and calls the graph's executor.
#include "RuntimeState.h"
#include "TensorMemory.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

namespace dcplan::replayer {
namespace {

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

/// Records the first failed collective (later ops refuse, naming it) and throws it with the op's
/// place: this rank, the op, its id and graph, and its index in the step's pass.
[[noreturn]] void collectiveFailed(RuntimeState& rt, const char* op, int64_t graphId, int64_t id,
                                   int64_t position, const std::exception& e) {
  std::string where = std::string(op);
  if (id >= 0) where += " of id " + std::to_string(id);
  if (graphId >= 0) where += " in graph " + std::to_string(graphId);
  if (rt.step_ >= 0)
    where += ", op " + std::to_string(position) + " of the " + (rt.inBackward_ ? "backward" : "forward") +
             " of step " + std::to_string(rt.step_);
  rt.failure_ =
      "rank " + std::to_string(rt.transport_->rank()) + ": " + where + ": a collective failed: " + failureMessage(e);
  if (dynamic_cast<const CollectiveMismatch*>(&e) != nullptr) TORCH_CHECK(false, rt.failure_);
  TORCH_CHECK(false, rt.failure_,
              " (a rank that died fails it at once; one that stopped answering after the process group's "
              "timeout, init_process_group(timeout=...))");
}

/// Runs the part of an op that may communicate. Refuses once a collective has failed (the ranks
/// are out of step from there), and turns a failed collective (an exception of the transport or
/// a c10::DistError, not a c10::Error of an argument check) into collectiveFailed's error.
template <typename Body>
decltype(auto) guarded(RuntimeState& rt, const char* op, int64_t graphId, int64_t id, Body&& body) {
  const int64_t position = rt.opInPass_++;
  TORCH_CHECK(rt.failure_.empty(), op, ": the runtime stopped at an earlier failure: ", rt.failure_,
              "; call dcplan.shutdown()");
  rt.place_ = OpPlace{op, id, graphId, rt.step_, position, rt.inBackward_};
  try {
    return body();
  } catch (const c10::DistError& e) {
    collectiveFailed(rt, op, graphId, id, position, e);
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    collectiveFailed(rt, op, graphId, id, position, e);
  }
}

/// Bytes a gather of p in dtype receives; 0 when a copy in that dtype is held
/// (the op is then served without communication).
int64_t gatherBytes(const Param& p, at::ScalarType dtype, int worldSize) {
  if (p.hasGathered() && p.gathered_.scalar_type() == dtype) return 0;
  return worldSize * p.shardNumel_ * static_cast<int64_t>(c10::elementSize(dtype));
}

/// Which of dsIds a gather launched now would really gather (those holding no copy in their
/// dtype, each once), and how many bytes that receives.
std::pair<std::vector<int64_t>, int64_t> toGather(RuntimeState& rt, Executor& ex,
                                                  const std::vector<int64_t>& dsIds,
                                                  const std::vector<at::ScalarType>& types) {
  std::vector<int64_t> ids;
  int64_t bytes = 0;
  for (size_t i = 0; i < dsIds.size(); ++i) {
    if (std::find(ids.begin(), ids.end(), dsIds[i]) != ids.end()) continue;
    const int64_t b =
        gatherBytes(ex.param("prefetch_params_fused", dsIds[i]), types[i], rt.transport_->worldSize());
    if (b == 0) continue;
    ids.push_back(dsIds[i]);
    bytes += b;
  }
  return {std::move(ids), bytes};
}

/// Tells the schedule which of dsIds a gather launched now would really gather.
void reportGathers(RuntimeState& rt, Executor& ex, int64_t graphId, const std::vector<int64_t>& dsIds,
                   const std::vector<at::ScalarType>& types, bool planned) {
  auto [launched, bytes] = toGather(rt, ex, dsIds, types);
  if (planned || !launched.empty()) rt.schedule_->onGatherLaunched(graphId, launched, bytes, planned);
}

/// The budget guard's turn at a planned group: true where it holds the group back, which the
/// schedule then logs.
bool heldBack(RuntimeState& rt, Executor& ex, const OpEvent& event, const SchedulePolicy::Prefetch& group,
              const std::vector<at::ScalarType>& types) {
  if (!guarding(rt) || !holdsBack(*rt.guard_, group.peakBytes)) return false;
  auto [ids, bytes] = toGather(rt, ex, group.dsIds, types);
  if (bytes == 0) return false;
  noteHold(rt,
           "a planned prefetch (graph " + std::to_string(event.graphId) + ", before its " + event.op + ")",
           group.peakBytes);
  const BudgetGuard& guard = *rt.guard_;
  rt.schedule_->onGuardHold(event.graphId,
                            SchedulePolicy::GuardHold{"prefetch", std::move(ids), bytes, group.peakBytes,
                                                      guard.excessBytes, guard.budgetBytes});
  return true;
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
    if (!group.dsIds.empty() && heldBack(rt, ex, event, group, types)) continue;
    reportGathers(rt, ex, event.graphId, group.dsIds, types, /*planned=*/true);
    if (!group.dsIds.empty()) ex.prefetchParamsFused(group.dsIds, types);
  }
}

}  // namespace

at::Tensor allgatherParam(const at::Tensor& shard, int64_t graphId, int64_t dsId,
                          std::optional<at::ScalarType> dtype) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("allgather_param");
  Executor& ex = executor("allgather_param", graphId);
  Param& p = ex.param("allgather_param", dsId);
  const at::ScalarType t = dtype.value_or(p.shard_.scalar_type());
  return guarded(rt, "allgather_param", graphId, dsId, [&] {
    scheduleBefore(
        rt, OpEvent{"allgather_param", graphId, dsId, gatherBytes(p, t, rt.transport_->worldSize()), t});
    reportGathers(rt, ex, graphId, {dsId}, {t}, /*planned=*/false);
    ObserverScope scope(
        rt, OpEvent{"allgather_param", graphId, dsId, gatherBytes(p, t, rt.transport_->worldSize()), t});
    return ex.allgatherParam(shard, dsId, dtype);
  });
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
  guarded(rt, "prefetch_params_fused", graphId, -1, [&] {
    scheduleBefore(rt, OpEvent{"prefetch_params_fused", graphId, -1, 0, at::ScalarType::Undefined});
    std::vector<at::ScalarType> types;
    int64_t bytes = 0;
    for (size_t i = 0; i < dsIds.size(); ++i) {
      Param& p = ex.param("prefetch_params_fused", dsIds[i]);
      TORCH_CHECK(shards[i].numel() == p.shardNumel_ || p.offloaded_, "prefetch_params_fused: ", p.label(),
                  ": params[", i, "] should be the registered shard of ", p.shardNumel_, " elements, got ",
                  shards[i].numel());
      types.push_back(dtypes ? (*dtypes)[i] : p.shard_.scalar_type());
      bytes += gatherBytes(p, types.back(), rt.transport_->worldSize());
    }
    reportGathers(rt, ex, graphId, dsIds, types, /*planned=*/false);
    ObserverScope scope(rt, OpEvent{"prefetch_params_fused", graphId, -1, bytes,
                                    types.empty() ? at::ScalarType::Undefined : types.front(), dsIds});
    ex.prefetchParamsFused(dsIds, types);
  });
}

at::Tensor waitAllgather(const at::Tensor& gathered, int64_t graphId, int64_t dsId) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("wait_allgather");
  Executor& ex = executor("wait_allgather", graphId);
  return guarded(rt, "wait_allgather", graphId, dsId, [&] {
    scheduleBefore(rt, OpEvent{"wait_allgather", graphId, dsId, 0, gathered.scalar_type()});
    ObserverScope scope(
        rt, OpEvent{"wait_allgather", graphId, dsId, tensorBytes(gathered), gathered.scalar_type()});
    return ex.waitAllgather(gathered, dsId);
  });
}

at::Tensor releaseParam(const at::Tensor& token, int64_t graphId, int64_t dsId, int64_t nUsers) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("release_param");
  Executor& ex = executor("release_param", graphId);
  guarded(rt, "release_param", graphId, dsId, [&] {
    scheduleBefore(rt, OpEvent{"release_param", graphId, dsId, 0, token.scalar_type()});
    ObserverScope scope(rt, OpEvent{"release_param", graphId, dsId, 0, token.scalar_type(), {}, nUsers});
    ex.releaseParam(dsId, nUsers);
  });
  return token;
}

at::Tensor reduceGrad(const at::Tensor& grad, int64_t graphId, int64_t dsId) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("reduce_grad");
  Executor& ex = executor("reduce_grad", graphId);
  guarded(rt, "reduce_grad", graphId, dsId, [&] {
    scheduleBefore(rt, OpEvent{"reduce_grad", graphId, dsId, tensorBytes(grad), grad.scalar_type()});
    ObserverScope scope(rt, OpEvent{"reduce_grad", graphId, dsId, tensorBytes(grad), grad.scalar_type()});
    ex.reduceGrad(grad, dsId);
  });
  // The reduced gradient lands in the registered grad buffer; the op's result
  // is an empty token that keeps the graph ordered.
  return at::empty({0}, grad.options());
}

void endBackward(int64_t graphId) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("end_backward");
  Executor& ex = executor("end_backward", graphId);
  guarded(rt, "end_backward", graphId, -1, [&] {
    scheduleBefore(rt, OpEvent{"end_backward", graphId, -1, 0, at::ScalarType::Undefined});
    ObserverScope scope(rt, OpEvent{"end_backward", graphId, -1, 0, at::ScalarType::Undefined});
    ex.endBackward();
  });
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
    case at::kFloat:
      return shm::DType::Float32;
    case at::kBFloat16:
      return shm::DType::BFloat16;
    case at::kHalf:
      return shm::DType::Float16;
    default:
      return std::nullopt;
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
    // The shared-memory group keeps its own failure state (and names the ranks itself).
    try {
      rt.localAllReduce_->allReduce(op, flat.data_ptr(), static_cast<size_t>(flat.numel()), *type);
    } catch (const shm::Error& e) {
      TORCH_CHECK(false, e.what());
    }
  } else {
    guarded(rt, op, -1, -1, [&] { rt.transport_->allReduce(flat)->wait(); });
  }
  if (!flat.is_same(tensor)) tensor.copy_(flat);
}

void withTransport(const char* op, const std::function<void(Transport&)>& fn) {
  std::lock_guard<std::mutex> lock(gMutex);
  fn(*state(op).transport_);
}

at::Tensor allGatherFlat(const char* op, const at::Tensor& flat) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state(op);
  TORCH_CHECK(flat.dim() == 1, op, ": the tensor should be flat (1-D), got ", flat.sizes());
  at::Tensor in = flat.contiguous();
  at::Tensor out = at::empty({rt.transport_->worldSize() * in.numel()}, in.options());
  // wait(), not synchronize(): a device transport makes the caller's stream wait, so the host goes
  // on and a CUDA graph can capture the call (clip_grad_norm_ inside dcplan.graphed_step).
  guarded(rt, op, -1, -1, [&] { rt.transport_->allGather(out, in)->wait(); });
  return out;
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
