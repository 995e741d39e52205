// Turns a trace's last step into typed graph runs with activation memory isolated.
#include "dcplan/planner/workload.h"

#include <algorithm>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "dcplan/planner/units.h"
#include "dcplan/schemas/dtype.h"

namespace dcplan::planner {
namespace {

OpKind kindOf(const std::string& op) {
  const auto role = schemas::opRole(op);
  if (!role) return OpKind::Other;  // validation refuses unknown ops; kept apart all the same
  switch (*role) {
    case schemas::OpRole::Gather:
      return OpKind::AllGather;
    case schemas::OpRole::GatherWait:
      return OpKind::Wait;
    case schemas::OpRole::Release:
      return OpKind::Release;
    case schemas::OpRole::ReduceGrad:
      return OpKind::ReduceGrad;
    case schemas::OpRole::EndBackward:
      return OpKind::EndBackward;
    case schemas::OpRole::Offload:
    case schemas::OpRole::Reload:
      return OpKind::CopyStart;
    case schemas::OpRole::CopyWait:
      return OpKind::CopyWait;
    case schemas::OpRole::Prefetch:  // a recorded prefetch: the plan places its own
    case schemas::OpRole::Free:
      return OpKind::Other;
  }
  return OpKind::Other;
}

bool needsParam(OpKind k) {
  return k == OpKind::AllGather || k == OpKind::Wait || k == OpKind::Release || k == OpKind::ReduceGrad;
}

/// The recorded micro-steps of the optimizer step that ends at `end` (steps are micro-steps; an
/// optimizer step is the grad_accum_steps of them ending at one after which the optimizer ran).
std::vector<size_t> microStepsEndingAt(const schemas::Trace& trace, size_t end, int64_t gradAccumSteps) {
  std::vector<size_t> micro{end};
  while (static_cast<int64_t>(micro.size()) < gradAccumSteps && micro.back() > 0 &&
         !(trace.steps[micro.back() - 1].optimizerUs > 0)) {
    micro.push_back(micro.back() - 1);
  }
  std::reverse(micro.begin(), micro.end());
  // Fewer micro-steps recorded than the step has: the first recorded one stands
  // in for the missing ones, so that per-step gather counts stay right.
  while (static_cast<int64_t>(micro.size()) < gradAccumSteps) micro.insert(micro.begin(), micro.front());
  return micro;
}

/// The host time of the optimizer step made of the recorded micro-steps `micro` (every op's
/// host_us and issue_us, and the last one's optimizer_host_us), or nothing where the trace lacks
/// one of them.
std::optional<double> stepHostUs(const schemas::Trace& trace, const std::vector<size_t>& micro) {
  if (!trace.steps[micro.back()].optimizerHostUs) return std::nullopt;
  double us = *trace.steps[micro.back()].optimizerHostUs;
  for (size_t m : micro) {
    for (const schemas::TraceGraph& g : trace.steps[m].graphs) {
      for (const schemas::OpEvent& e : g.events) {
        if (!e.hostUs || !e.issueUs) return std::nullopt;
        us += *e.hostUs + *e.issueUs;
      }
    }
  }
  return us;
}

/// The recorded step to plan from: the last one after which the optimizer ran, unless the
/// recorded optimizer steps disagree on host time (kStepsAgreeShare): then the fastest of them,
/// with `note` saying so (a machine still warming up, or busy with something else, only adds
/// time: on 2 CPU ranks the demo's recorded steps took 118, 74 and 64 ms after 2 warm-up steps).
/// A CUDA graph's plan takes the device's own times, which the recorder measures once: the last step.
size_t steadyOptimizerStep(const schemas::Trace& trace, int64_t gradAccumSteps, StepReplay replay,
                           std::string& note) {
  std::vector<size_t> ends;
  for (size_t i = 0; i < trace.steps.size(); ++i) {
    if (trace.steps[i].optimizerUs > 0) ends.push_back(i);
  }
  if (ends.empty()) return trace.steps.size() - 1;
  if (ends.size() < 2 || replay == StepReplay::CudaGraph) return ends.back();
  std::vector<std::pair<double, size_t>> hosts;  // host time, step
  for (size_t e : ends) {
    std::vector<size_t> micro = microStepsEndingAt(trace, e, gradAccumSteps);
    // A step with fewer recorded micro-steps than it has (the first, recorded part-way) would look
    // fast: compare complete steps only.
    if (std::adjacent_find(micro.begin(), micro.end()) != micro.end()) continue;
    std::optional<double> us = stepHostUs(trace, micro);
    if (!us) return ends.back();
    hosts.emplace_back(*us, e);
  }
  if (hosts.size() < 2) return ends.back();
  auto [fastest, slowest] = std::minmax_element(hosts.begin(), hosts.end());
  if (slowest->first <= fastest->first * (1.0 + kStepsAgreeShare)) return ends.back();
  const size_t chosen = fastest->second;
  std::string times;
  for (const auto& [us, e] : hosts) {
    times += (times.empty() ? "" : ", ") + formatFixed(us / 1000, 1) + " ms (step " +
             std::to_string(trace.steps[e].index) + ")";
  }
  note = "the recorded optimizer steps disagree on host time by more than " +
         formatFixed(100 * kStepsAgreeShare, 0) + "%: " + times + "; planned from step " +
         std::to_string(trace.steps[chosen].index) + ", the fastest" +
         (chosen == ends.back() ? "" : ", not the last") +
         "; record more warm-up steps (dcplan record --warmup) where the machine is still warming up";
  return chosen;
}

int dtypeBytes(const std::string& dtype, const char* pointer) {
  auto size = schemas::dtypeSize(dtype);
  if (!size) {
    throw std::invalid_argument(std::string(pointer) + ": unknown dtype '" + dtype + "'");
  }
  return *size;
}

/// What the recorded run's runtime held besides activations, op by op: gathered copies, gradients
/// waiting in a bucket, launched buckets and gradient shards. A trace is recorded without a plan:
/// gather on use and the default buckets, flushed when the next gradient would take one past
/// kDefaultBucketBytes. Its activations are its recorded memory less these (the simulator adds
/// the plan's own). Sizes are the recorded run's: its world size, its transport's allocator.
class RecordedHoldings {
 public:
  RecordedHoldings(const Workload& w, const schemas::Trace& trace)
      : stage_(w.stage), memory_(RuntimeMemory::of(trace.meta, w.traceWorldSize)) {
    for (const schemas::TraceParam& p : trace.params) sizes_[p.id] = memory_.param(p.numel);
    // ZeRO-1's flat bucket buffer: the configured size, in the reduce dtype's [world, cols] layout.
    const uint64_t ranks = static_cast<uint64_t>(w.traceWorldSize);
    const uint64_t cols = std::max<uint64_t>(1, kDefaultBucketBytes / (memory_.reduceSize * ranks));
    flatBufferBytes_ = memory_.allocation(cols * memory_.reduceSize * ranks);
  }

  /// Bytes held (besides baseline and activations) before the next op.
  uint64_t heldBytes() const { return gatheredBytes_ + held_ + deferred_ + shardGrads_ + flat_; }

  /// ZeRO-2/3: the gradient a reduce_grad hands over (in its memory_bytes already).
  uint64_t arrivingBytes(const schemas::OpEvent& e) const {
    return defers(e) ? sizes_.at(e.dsIds[0]).gradient : 0;
  }

  /// Updates what is held after op e of a micro-step (sync: the one the optimizer step follows).
  void after(const schemas::OpEvent& e, bool sync) {
    if (e.op == "allgather_param" || e.op == "prefetch_params_fused") {
      // (A Gloo call's scratch is not taken out of the activations. Before session 12 Gloo's
      // worker thread freed it at a time of its own, and taking it out made a plan on 2 CPU
      // ranks run 3.8% over its budget. Since then the transport frees it at the wait; taking
      // it out was tried again: the peaks of tests/memory stayed exact, but single ops ran up
      // to 2.6% over the simulated memory, against 0.6% with it left in.)
      for (int64_t id : e.dsIds) {
        if (gathered_.count(id)) continue;
        const uint64_t b = sizes_.at(id).gathered;
        gathered_[id] = b;
        gatheredBytes_ += b;
      }
    } else if (e.op == "release_param" && !e.dsIds.empty() && stage_ == 3) {
      // (ZeRO-1/2 keep every gathered copy until the optimizer step.)
      auto it = gathered_.find(e.dsIds[0]);
      if (it != gathered_.end()) {
        gatheredBytes_ -= it->second;
        gathered_.erase(it);
      }
    } else if (defers(e)) {
      if (flushesBefore(filling_, e.bytes, kDefaultBucketBytes)) {
        // Launched here: packed (its gradients freed) and held with its output until the next
        // launch; the one before is freed here. (The reduce-scatter's own scratch is not taken
        // out: the recorded run may have freed it already; the simulator counts the plan's.)
        held_ = memory_.allocation(filling_) + launch();
        filling_ = 0;
        deferred_ = 0;
      }
      filling_ += e.bytes;
      deferred_ += sizes_.at(e.dsIds[0]).gradient;
      members_.push_back(e.dsIds[0]);
    } else if (stage_ < 2 && sync && e.op == "reduce_grad" && e.bytes > 0 && !e.dsIds.empty()) {
      // ZeRO-1 copies the gradient into a flat buffer of the configured size, allocated at the
      // first gradient of each of its two buffers and kept until end_backward.
      if (flushesBefore(filling_, e.bytes, kDefaultBucketBytes)) {
        launch();
        filling_ = 0;
        current_ = 1 - current_;
      }
      if (!allocated_[current_]) {
        allocated_[current_] = true;
        flat_ += flatBufferBytes_;
      }
      filling_ += e.bytes;
      members_.push_back(e.dsIds[0]);
    } else if (e.op == "end_backward") {
      launch();  // the last bucket: flushed, drained and freed, its gradient shards made
      filling_ = held_ = deferred_ = flat_ = 0;
      allocated_[0] = allocated_[1] = false;
    }
  }

 private:
  bool defers(const schemas::OpEvent& e) const {
    return stage_ >= 2 && e.op == "reduce_grad" && e.bytes > 0 && !e.dsIds.empty();
  }

  /// The bucket's gradients are reduced (RuntimeMemory::reduced): returns what is held with it
  /// until the next launch; the shards' new gradients stay.
  uint64_t launch() {
    uint64_t held = 0;
    for (int64_t id : members_) {
      const ReducedMemory left = memory_.reduced(sizes_.at(id), !hasShardGrad_[id]);
      hasShardGrad_[id] = 1;
      held += left.held;
      shardGrads_ += left.kept;
    }
    members_.clear();
    return held;
  }

  int64_t stage_;
  RuntimeMemory memory_;
  std::unordered_map<int64_t, ParamMemory> sizes_;
  std::unordered_map<int64_t, uint64_t> gathered_;
  uint64_t gatheredBytes_ = 0;
  uint64_t filling_ = 0;   ///< reduce bytes of the bucket being filled
  uint64_t held_ = 0;      ///< ZeRO-2/3: the last launched bucket, until the next launch
  uint64_t deferred_ = 0;  ///< ZeRO-2/3: gradients held until their bucket is packed
  std::vector<int64_t> members_;
  std::unordered_map<int64_t, char> hasShardGrad_;
  uint64_t shardGrads_ = 0;
  uint64_t flatBufferBytes_ = 0;  ///< ZeRO-1
  uint64_t flat_ = 0;
  bool allocated_[2] = {false, false};
  int current_ = 0;
};

}  // namespace

int32_t Workload::paramIndex(int64_t id) const {
  auto it = std::lower_bound(sortedIds_.begin(), sortedIds_.end(), id);
  if (it == sortedIds_.end() || *it != id) return -1;
  return sortedIdx_[static_cast<size_t>(it - sortedIds_.begin())];
}

int32_t Workload::graphIndex(int64_t id) const {
  for (size_t i = 0; i < graphs.size(); ++i) {
    if (graphs[i].id == id) return static_cast<int32_t>(i);
  }
  return -1;
}

uint64_t GraphRun::mostActivationBytes() const {
  uint64_t most = 0;
  for (uint64_t a : activationBytes) most = std::max(most, a);
  for (uint64_t a : computePeakBytes) most = std::max(most, a);
  return most;
}

double Workload::computeUs() const {
  double total = opDeviceUs();
  for (const GraphRun& r : runs) total = std::accumulate(r.computeUs.begin(), r.computeUs.end(), total);
  return total;
}

double Workload::opDeviceUs() const {
  double total = 0;
  for (const GraphRun& r : runs) total = std::accumulate(r.opDeviceUs.begin(), r.opDeviceUs.end(), total);
  return total;
}

std::vector<int32_t> gathersPerStep(const Workload& w) {
  std::vector<int32_t> count(w.params.size(), 0);
  std::vector<char> allocated(w.params.size(), 0);
  for (const GraphRun& run : w.runs) {
    for (const WorkOp& op : w.graphs[static_cast<size_t>(run.graph)].ops) {
      size_t p = static_cast<size_t>(op.param);
      if (op.kind == OpKind::Release) allocated[p] = 0;
      if ((op.kind == OpKind::AllGather || op.kind == OpKind::Wait) && !allocated[p]) {
        allocated[p] = 1;
        count[p]++;
      }
    }
  }
  return count;
}

std::optional<double> measuredLaunchUs(const Workload& w) {
  if (!w.hostLane) return std::nullopt;
  // The recorded run is the default schedule: a parameter not held is gathered at its
  // allgather_param; ZeRO-1/2 keep every copy, so only a step's first gather of it launches.
  std::vector<double> launched, released;
  std::vector<char> held(w.params.size(), 0);
  for (const GraphRun& run : w.runs) {
    const std::vector<WorkOp>& ops = w.graphs[static_cast<size_t>(run.graph)].ops;
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].kind == OpKind::Release) {
        released.push_back(run.issueUs[i]);
        if (w.stage == 3) held[static_cast<size_t>(ops[i].param)] = 0;
      } else if (ops[i].kind == OpKind::AllGather && !held[static_cast<size_t>(ops[i].param)]) {
        held[static_cast<size_t>(ops[i].param)] = 1;
        launched.push_back(run.issueUs[i]);
      }
    }
  }
  if (launched.empty() || released.empty()) return std::nullopt;
  auto median = [](std::vector<double>& v) {
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    return v[v.size() / 2];
  };
  return std::max(0.0, median(launched) - median(released));
}

Workload makeWorkload(const schemas::Trace& trace, int64_t worldSize, StepReplay replay) {
  Workload w;
  w.traceWorldSize = std::max<int64_t>(1, trace.meta.worldSize);
  w.worldSize = worldSize > 0 ? worldSize : w.traceWorldSize;
  w.stage = trace.meta.stage;
  w.gradAccumSteps = std::max<int64_t>(1, trace.meta.gradAccumSteps);
  w.paramDtype = trace.meta.paramDtype;
  w.reduceDtype = trace.meta.reduceDtype;
  w.capacityBytes = trace.memory.capacityBytes;
  w.memory = RuntimeMemory::of(trace.meta, w.worldSize);
  // Shards and optimizer state are what the baseline holds; they shrink with
  // the number of ranks sharing them.
  w.baselineBytes =
      static_cast<uint64_t>(static_cast<double>(trace.memory.baselineBytes) *
                            static_cast<double>(w.traceWorldSize) / static_cast<double>(w.worldSize));
  if (trace.steps.empty()) throw std::invalid_argument("/steps: the trace has no step to plan from");

  int gatherSize = dtypeBytes(w.paramDtype, "/meta/param_dtype");
  int reduceSize = dtypeBytes(w.reduceDtype, "/meta/reduce_dtype");
  for (const schemas::TraceParam& p : trace.params) {
    WorkParam wp;
    wp.id = p.id;
    wp.name = p.name;
    // Shards are padded to equal length, so a gather moves shard * world elements.
    uint64_t shard = static_cast<uint64_t>((p.numel + w.worldSize - 1) / w.worldSize);
    wp.gatherBytes = shard * static_cast<uint64_t>(w.worldSize) * static_cast<uint64_t>(gatherSize);
    wp.gradBytes = shard * static_cast<uint64_t>(w.worldSize) * static_cast<uint64_t>(reduceSize);
    wp.mem = w.memory.param(p.numel);
    wp.requiresGrad = p.requiresGrad;
    w.params.push_back(std::move(wp));
  }
  std::vector<size_t> order(w.params.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return w.params[a].id < w.params[b].id; });
  for (size_t i : order) {
    w.sortedIds_.push_back(w.params[i].id);
    w.sortedIdx_.push_back(static_cast<int32_t>(i));
  }

  const size_t end = steadyOptimizerStep(trace, w.gradAccumSteps, replay, w.stepChoice);
  std::vector<size_t> micro = microStepsEndingAt(trace, end, w.gradAccumSteps);
  w.traceStep = trace.steps[end].index;
  w.optimizerUs = trace.steps[end].optimizerUs;
  w.waitsBlockHost = w.memory.transport == RuntimeMemory::Transport::Gloo;
  // The host lane needs every op's host times; one missing (an older recorder, a merged rank
  // without them) and the step is simulated on the device's lane alone.
  w.hostLane = trace.steps[end].optimizerHostUs.has_value();
  for (size_t m : micro) {
    for (const schemas::TraceGraph& tg : trace.steps[m].graphs) {
      for (const schemas::OpEvent& e : tg.events) w.hostLane = w.hostLane && e.hostUs && e.issueUs;
    }
  }
  w.optimizerHostUs = w.hostLane ? *trace.steps[end].optimizerHostUs : 0;
  if (replay == StepReplay::CudaGraph) {
    // A graph replays the step without the host: the device's own times, no host lane.
    w.cudaGraph = true;
    w.hostLane = false;
    w.optimizerHostUs = 0;
    const std::string lacks =
        ": a plan for a CUDA graph (--cuda-graph) needs the device's own times, which the "
        "recorder measures on a GPU in the last warm-up step (dcplan record --warmup of at "
        "least 2; docs/recording.md); this trace has none here (or the device caught up with "
        "the host in that step: the recorder warned)";
    if (!trace.steps[end].optimizerDeviceUs)
      throw std::invalid_argument("/steps/" + std::to_string(end) + "/optimizer_device_us" + lacks);
    w.optimizerUs = *trace.steps[end].optimizerDeviceUs;
    for (size_t m : micro) {
      for (size_t g = 0; g < trace.steps[m].graphs.size(); ++g) {
        const auto& events = trace.steps[m].graphs[g].events;
        for (size_t e = 0; e < events.size(); ++e) {
          if (!events[e].deviceUs)
            throw std::invalid_argument("/steps/" + std::to_string(m) + "/graphs/" + std::to_string(g) +
                                        "/events/" + std::to_string(e) + "/device_us" + lacks);
        }
      }
    }
  }
  std::unordered_map<int64_t, int32_t> runsOfGraph;
  RecordedHoldings recorded(w, trace);
  for (size_t m = 0; m < micro.size(); ++m) {
    const size_t stepIndex = micro[m];
    const bool sync = m + 1 == micro.size();  // the micro-step the optimizer step follows
    const schemas::TraceStep& step = trace.steps[stepIndex];
    std::string stepPtr = "/steps/" + std::to_string(stepIndex);
    for (size_t gi = 0; gi < step.graphs.size(); ++gi) {
      const schemas::TraceGraph& tg = step.graphs[gi];
      std::string graphPtr = stepPtr + "/graphs/" + std::to_string(gi);
      int32_t g = w.graphIndex(tg.id);
      bool first = g < 0;
      if (first) {
        g = static_cast<int32_t>(w.graphs.size());
        w.graphs.push_back(WorkGraph{tg.id, tg.kind, {}});
      } else if (w.graphs[static_cast<size_t>(g)].kind != tg.kind ||
                 w.graphs[static_cast<size_t>(g)].ops.size() != tg.events.size()) {
        throw std::invalid_argument(graphPtr + ": graph " + std::to_string(tg.id) +
                                    " differs from its first run in this step (" +
                                    std::to_string(tg.events.size()) + " ops against " +
                                    std::to_string(w.graphs[static_cast<size_t>(g)].ops.size()) +
                                    "); a plan needs every run of a graph to issue the same ops");
      }
      WorkGraph& graph = w.graphs[static_cast<size_t>(g)];
      GraphRun run;
      run.graph = g;
      run.microStep = runsOfGraph[tg.id]++;
      run.computeUs.reserve(tg.events.size());
      run.activationBytes.reserve(tg.events.size());
      run.computePeakBytes.reserve(tg.events.size());
      run.copyUs.assign(tg.events.size(), 0.0);
      for (size_t ei = 0; ei < tg.events.size(); ++ei) {
        const schemas::OpEvent& e = tg.events[ei];
        std::string evPtr = graphPtr + "/events/" + std::to_string(ei);
        WorkOp op;
        op.kind = kindOf(e.op);
        op.seq = e.seq;
        if (needsParam(op.kind)) {
          if (e.dsIds.empty()) throw std::invalid_argument(evPtr + "/ds_ids: " + e.op + " needs a ds_id");
          op.param = w.paramIndex(e.dsIds[0]);
          if (op.param < 0) {
            throw std::invalid_argument(evPtr + "/ds_ids/0: unknown ds_id " + std::to_string(e.dsIds[0]));
          }
        }
        if (op.kind == OpKind::CopyStart) {
          op.copyBytes = e.bytes;
          op.hostToDevice = schemas::opRole(e.op) == schemas::OpRole::Reload;
          run.copyUs[ei] = std::max(0.0, e.endUs - e.startUs);
        }
        if (first) {
          graph.ops.push_back(op);
        } else {
          const WorkOp& had = graph.ops[ei];
          if (had.kind != op.kind || had.param != op.param) {
            throw std::invalid_argument(evPtr + ": op '" + e.op + "' differs from the first run of graph " +
                                        std::to_string(tg.id) + " at seq " + std::to_string(e.seq) +
                                        "; a plan needs every run of a graph to issue the same ops");
          }
        }
        run.computeUs.push_back(std::max(0.0, w.cudaGraph ? *e.deviceUs : e.computeUs));
        if (w.cudaGraph) run.opDeviceUs.push_back(std::max(0.0, e.opDeviceUs.value_or(0.0)));
        if (w.hostLane) {
          run.hostUs.push_back(*e.hostUs);
          run.issueUs.push_back(*e.issueUs);
        }
        // What the recorded run held besides activations, before this op; a reduce_grad's gradient
        // is the simulator's from this op on (it holds it in the plan's bucket).
        const uint64_t other = trace.memory.baselineBytes + recorded.heldBytes();
        const uint64_t arriving = recorded.arrivingBytes(e);
        run.activationBytes.push_back(e.memoryBytes > other + arriving ? e.memoryBytes - other - arriving
                                                                       : 0);
        // What the recorded run held during the compute before this op is what it held after the
        // op before: the same `other`.
        const uint64_t peak = std::max(e.memoryBytes, e.peakBytes);
        run.computePeakBytes.push_back(peak > other ? peak - other : 0);
        recorded.after(e, sync);
      }
      w.runs.push_back(std::move(run));
    }
  }
  for (WorkGraph& g : w.graphs) {
    std::vector<char> seen(w.params.size(), 0);
    for (size_t i = g.ops.size(); i-- > 0;) {
      WorkOp& op = g.ops[i];
      if (op.kind != OpKind::Release || seen[static_cast<size_t>(op.param)]) continue;
      seen[static_cast<size_t>(op.param)] = 1;
      op.lastRelease = true;
    }
  }
  return w;
}

}  // namespace dcplan::planner
