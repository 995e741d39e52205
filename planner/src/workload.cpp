// Turns a trace's recorded step into typed graph runs with activation memory isolated.
#include "dcplan/planner/workload.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "dcplan/planner/units.h"
#include "dcplan/schemas/dtype.h"
#include "recorded_holdings.h"
#include "step_choice.h"

namespace dcplan::planner {
namespace {

using detail::RecordedHoldings;

bool needsParam(OpRole r) {
  return r == OpRole::Gather || r == OpRole::GatherWait || r == OpRole::Release || r == OpRole::ReduceGrad;
}

int dtypeBytes(const std::string& dtype, const char* pointer) {
  auto size = schemas::dtypeSize(dtype);
  if (!size) {
    throw std::invalid_argument(std::string(pointer) + ": unknown dtype '" + dtype + "'");
  }
  return *size;
}

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
      if (op.role == OpRole::Release) allocated[p] = 0;
      if ((op.role == OpRole::Gather || op.role == OpRole::GatherWait) && !allocated[p]) {
        allocated[p] = 1;
        count[p]++;
      }
    }
  }
  return count;
}

double upperMedian(std::vector<double>& values) {
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(values.size() / 2), values.end());
  return values[values.size() / 2];
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
      if (ops[i].role == OpRole::Release) {
        released.push_back(run.issueUs[i]);
        if (w.stage == 3) held[static_cast<size_t>(ops[i].param)] = 0;
      } else if (ops[i].role == OpRole::Gather && !held[static_cast<size_t>(ops[i].param)]) {
        held[static_cast<size_t>(ops[i].param)] = 1;
        launched.push_back(run.issueUs[i]);
      }
    }
  }
  if (launched.empty() || released.empty()) return std::nullopt;
  return std::max(0.0, upperMedian(launched) - upperMedian(released));
}

namespace {

/// The planned shape of the job: world size, dtypes, memory model and each parameter's sizes.
Workload workloadShape(const schemas::Trace& trace, int64_t worldSize) {
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
  const int gatherSize = dtypeBytes(w.paramDtype, "/meta/param_dtype");
  const int reduceSize = dtypeBytes(w.reduceDtype, "/meta/reduce_dtype");
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
    if (p.optimizerStateBytes && p.shardNumel > 0) {
      // Per-element state: it shrinks and grows with the shard.
      wp.optimizerStateBytes =
          static_cast<uint64_t>(static_cast<double>(*p.optimizerStateBytes) * static_cast<double>(shard) /
                                static_cast<double>(p.shardNumel));
    }
    wp.optimizerImpl = p.optimizerImpl.value_or("");
    wp.optimizerGroup = p.optimizerGroup.value_or(-1);
    w.params.push_back(std::move(wp));
  }
  w.optimizerStateRecorded = std::any_of(trace.params.begin(), trace.params.end(),
                                         [](const auto& p) { return p.optimizerStateBytes.has_value(); });
  std::vector<size_t> order(w.params.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return w.params[a].id < w.params[b].id; });
  for (size_t i : order) {
    w.sortedIds_.push_back(w.params[i].id);
    w.sortedIdx_.push_back(static_cast<int32_t>(i));
  }
  return w;
}

/// The JSON pointer of the first element of the step without the device's own time
/// (optimizer_device_us, then each op's device_us); none where every one has it.
std::optional<std::string> firstMissingDeviceTime(const schemas::Trace& trace, size_t end,
                                                  const std::vector<size_t>& micro) {
  if (!trace.steps[end].optimizerDeviceUs) return "/steps/" + std::to_string(end) + "/optimizer_device_us";
  for (size_t m : micro) {
    for (size_t g = 0; g < trace.steps[m].graphs.size(); ++g) {
      const auto& events = trace.steps[m].graphs[g].events;
      for (size_t e = 0; e < events.size(); ++e) {
        if (!events[e].deviceUs) {
          return "/steps/" + std::to_string(m) + "/graphs/" + std::to_string(g) + "/events/" +
                 std::to_string(e) + "/device_us";
        }
      }
    }
  }
  return std::nullopt;
}

/// Which times the step is planned with: the host lane where every op of the step has host times;
/// the device's own for a CUDA graph (refused, naming the first element without them, if absent)
/// and, beside the host lane, for a GPU's eager step whose trace has them all.
void chooseTimes(Workload& w, const schemas::Trace& trace, size_t end, const std::vector<size_t>& micro,
                 StepReplay replay) {
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
  w.recordedHostUs = w.hostLane ? detail::stepHostUs(trace, micro).value_or(0) : 0;
  // Charged on the host lane (SimResult::checkUs): a trace without host times has none to charge on;
  // one rank has no other to agree with, and does not check.
  w.checksCollectives =
      trace.meta.checksCollectives && w.hostLane && replay != StepReplay::CudaGraph && w.worldSize > 1;
  if (replay != StepReplay::CudaGraph) {
    // A GPU's eager step: the device lane runs the device's own times where the device-lead step
    // measured them, the host lane the host's. The recorded compute_us of a host-bound stretch is
    // the host's pace (the GPU idled), recorder's work and all; on it a plan that issues less, or a
    // host calibrated faster (--calibrate), was never predicted below the recorded step.
    w.ownDeviceTimes = replay == StepReplay::Issued && w.hostLane && !w.waitsBlockHost &&
                       !firstMissingDeviceTime(trace, end, micro);
    if (w.ownDeviceTimes) w.optimizerUs = *trace.steps[end].optimizerDeviceUs;
    return;
  }
  // A graph replays the step without the host: the device's own times, no host lane.
  w.cudaGraph = true;
  w.ownDeviceTimes = true;
  w.hostLane = false;
  w.optimizerHostUs = 0;
  w.recordedHostUs = 0;
  const std::string lacks =
      std::string(": a plan for a CUDA graph (") +
      (trace.meta.graphed ? "the trace's step ran in dcplan.graphed_step, meta.graphed" : "--cuda-graph") +
      ") needs the device's own times, which the "
      "recorder measures on a GPU in the last warm-up step (dcplan record --warmup of at "
      "least 2; docs/recording.md); this trace has none here (or the device caught up with "
      "the host in that step: the recorder warned)";
  if (const auto missing = firstMissingDeviceTime(trace, end, micro)) {
    throw std::invalid_argument(*missing + lacks);
  }
  w.optimizerUs = *trace.steps[end].optimizerDeviceUs;
}

/// The typed op of trace event `e` (at JSON pointer `ptr`).
WorkOp readOp(const Workload& w, const schemas::OpEvent& e, const std::string& ptr) {
  const std::optional<OpRole> role = schemas::opRole(e.op);
  if (!role) throw std::invalid_argument(ptr + "/op: unknown op '" + e.op + "'");
  WorkOp op;
  op.role = *role;
  op.seq = e.seq;
  if (needsParam(op.role)) {
    if (e.dsIds.empty()) throw std::invalid_argument(ptr + "/ds_ids: " + e.op + " needs a ds_id");
    op.param = w.paramIndex(e.dsIds[0]);
    if (op.param < 0)
      throw std::invalid_argument(ptr + "/ds_ids/0: unknown ds_id " + std::to_string(e.dsIds[0]));
  }
  if (startsCopy(op.role)) op.copyBytes = e.bytes;
  return op;
}

/// The graph a recorded run belongs to: a new one at its first run, else the one it must repeat.
WorkGraph& graphOf(Workload& w, const schemas::TraceGraph& tg, const std::string& ptr, bool& first) {
  int32_t g = w.graphIndex(tg.id);
  first = g < 0;
  if (first) {
    w.graphs.push_back(WorkGraph{tg.id, tg.kind, {}, tg.inputShapes});  // a forward's inputs: its first run's
    return w.graphs.back();
  }
  WorkGraph& graph = w.graphs[static_cast<size_t>(g)];
  if (graph.kind != tg.kind || graph.ops.size() != tg.events.size()) {
    throw std::invalid_argument(
        ptr + ": graph " + std::to_string(tg.id) + " differs from its first run in this step (" +
        std::to_string(tg.events.size()) + " ops against " + std::to_string(graph.ops.size()) +
        "); a plan needs every run of a graph to issue the same ops");
  }
  return graph;
}

/// One recorded run of a graph: its ops (checked against the graph's first run), times, and the
/// activation memory left once what `recorded` held is taken out.
GraphRun readRun(Workload& w, const schemas::TraceGraph& tg, const std::string& ptr, int32_t microStep,
                 uint64_t baselineBytes, RecordedHoldings& recorded, bool sync) {
  bool first = false;
  WorkGraph& graph = graphOf(w, tg, ptr, first);
  GraphRun run;
  run.graph = static_cast<int32_t>(&graph - w.graphs.data());
  run.microStep = microStep;
  run.copyUs.assign(tg.events.size(), 0.0);
  for (size_t ei = 0; ei < tg.events.size(); ++ei) {
    const schemas::OpEvent& e = tg.events[ei];
    const std::string evPtr = ptr + "/events/" + std::to_string(ei);
    const WorkOp op = readOp(w, e, evPtr);
    if (first) {
      graph.ops.push_back(op);
    } else if (graph.ops[ei].role != op.role || graph.ops[ei].param != op.param) {
      throw std::invalid_argument(evPtr + ": op '" + e.op + "' differs from the first run of graph " +
                                  std::to_string(tg.id) + " at seq " + std::to_string(e.seq) +
                                  "; a plan needs every run of a graph to issue the same ops");
    }
    if (startsCopy(op.role)) run.copyUs[ei] = std::max(0.0, e.endUs - e.startUs);
    run.computeUs.push_back(std::max(0.0, w.ownDeviceTimes ? *e.deviceUs : e.computeUs));
    if (w.ownDeviceTimes) run.opDeviceUs.push_back(std::max(0.0, e.opDeviceUs.value_or(0.0)));
    if (w.hostLane) {
      run.hostUs.push_back(*e.hostUs);
      run.issueUs.push_back(*e.issueUs);
    }
    // What the recorded run held besides activations, before this op; a reduce_grad's gradient
    // is the simulator's from this op on (it holds it in the plan's bucket).
    const uint64_t other = baselineBytes + recorded.heldBytes();
    const uint64_t arriving = recorded.arrivingBytes(e);
    const uint64_t activation = e.memoryBytes > other + arriving ? e.memoryBytes - other - arriving : 0;
    // What the recorded run held during the compute before this op is what it held after the
    // op before: the same `other`.
    const uint64_t peak = std::max(e.memoryBytes, e.peakBytes);
    const uint64_t computePeak = peak > other ? peak - other : 0;
    run.activationBytes.push_back(activation);
    run.computePeakBytes.push_back(computePeak);
    recorded.after(e, sync);
  }
  return run;
}

/// The saved activations of a micro-step's one forward run that offloading can move (freed_at and
/// used_at recorded), paired with its one backward run (`first`: the micro-step's first run in
/// w.runs); none where it runs more than one of either.
void pairSavedActivations(Workload& w, const schemas::TraceStep& step, const std::string& stepPtr,
                          size_t first) {
  int32_t forward = -1, backward = -1, forwards = 0, backwards = 0;
  for (size_t gi = 0; gi < step.graphs.size(); ++gi) {
    const bool isForward = step.graphs[gi].kind == schemas::GraphKind::Forward;
    (isForward ? forward : backward) = static_cast<int32_t>(first + gi);
    ++(isForward ? forwards : backwards);
  }
  if (forwards != 1 || backwards != 1) return;
  GraphRun& run = w.runs[static_cast<size_t>(forward)];
  const size_t backwardOps =
      w.graphs[static_cast<size_t>(w.runs[static_cast<size_t>(backward)].graph)].ops.size();
  const size_t gi = static_cast<size_t>(forward) - first;
  const auto& saved = step.graphs[gi].savedActivations;
  for (size_t i = 0; i < saved.size(); ++i) {
    const schemas::SavedActivation& a = saved[i];
    if (!a.freedAt || !a.usedAt) continue;
    if (static_cast<size_t>(*a.usedAt) >= backwardOps) {
      throw std::invalid_argument(stepPtr + "/graphs/" + std::to_string(gi) + "/saved_activations/" +
                                  std::to_string(i) +
                                  "/used_at: expected an op of the micro-step's backward (0 to " +
                                  std::to_string(backwardOps - 1) + "), got " + std::to_string(*a.usedAt));
    }
    run.saved.push_back(WorkSaved{a.packs.front(), a.bytes, static_cast<int32_t>(a.seq),
                                  static_cast<int32_t>(*a.freedAt), static_cast<int32_t>(*a.usedAt)});
  }
  run.backwardRun = backward;
}

/// The optimizer steps the rank's shards: with --world-size its device work (on CPU ranks, where
/// the host is the device, its host time too) shrinks or grows with them, as the baseline does.
/// On a GPU the host's time issuing it is per tensor, whatever their size: kept. Under ZeRO-3
/// what the optimizer step holds beyond the step's activations (the first op's recorded peak
/// above its memory) scales too: the gradient shards it steps and its temporaries, per shard
/// (1xH100, 1 -> 2 GPUs: 3.5 GiB too high unscaled), and what the script keeps meanwhile (the
/// last micro-step's logits: per rank, so that part errs low for N > W). ZeRO-1/2 keep it: their
/// gathered copies and ZeRO-1's full gradients, held there too, do not shrink.
void scaleOptimizerToShards(Workload& w) {
  const double shards = static_cast<double>(w.traceWorldSize) / static_cast<double>(w.worldSize);
  w.optimizerUs *= shards;
  if (w.waitsBlockHost) w.optimizerHostUs *= shards;
  if (w.stage < 3 || w.runs.empty() || w.runs.front().computePeakBytes.empty()) return;
  auto scaled = [shards](uint64_t bytes) {
    return static_cast<uint64_t>(std::llround(static_cast<double>(bytes) * shards));
  };
  GraphRun& first = w.runs.front();
  const uint64_t activation = first.activationBytes.front();
  uint64_t& peak = first.computePeakBytes.front();
  if (peak > activation) peak = activation + scaled(peak - activation);
  if (w.leastOptimizerExcessBytes != std::numeric_limits<uint64_t>::max()) {
    w.leastOptimizerExcessBytes = scaled(w.leastOptimizerExcessBytes);
  }
}

/// Marks each graph's last release of each parameter.
void markLastReleases(Workload& w) {
  for (WorkGraph& g : w.graphs) {
    std::vector<char> seen(w.params.size(), 0);
    for (size_t i = g.ops.size(); i-- > 0;) {
      WorkOp& op = g.ops[i];
      if (op.role != OpRole::Release || seen[static_cast<size_t>(op.param)]) continue;
      seen[static_cast<size_t>(op.param)] = 1;
      op.lastRelease = true;
    }
  }
}

}  // namespace

bool endsPersistentCopy(const Workload& w, const WorkGraph& g, const WorkOp& op) {
  return w.stage == 3 && g.kind == schemas::GraphKind::Backward && op.role == OpRole::Release &&
         op.lastRelease && w.params[static_cast<size_t>(op.param)].requiresGrad;
}

std::vector<schemas::PersistentEnd> persistentEnds(const Workload& w, const WorkGraph& g,
                                                   const std::vector<char>& persistent) {
  std::vector<schemas::PersistentEnd> out;
  for (size_t i = 0; i < g.ops.size(); ++i) {
    const WorkOp& op = g.ops[i];
    if (op.param >= 0 && persistent[static_cast<size_t>(op.param)] && endsPersistentCopy(w, g, op))
      out.push_back({static_cast<int64_t>(i), w.params[static_cast<size_t>(op.param)].id});
  }
  return out;
}

void scaleCompute(Workload& w, double factor) {
  for (GraphRun& run : w.runs) {
    for (std::vector<double>* times : {&run.computeUs, &run.hostUs, &run.issueUs}) {
      for (double& t : *times) t *= factor;
    }
  }
  w.optimizerUs *= factor;
  w.optimizerHostUs *= factor;
  w.recordedHostUs *= factor;
}

void scaleHost(Workload& w, double factor) {
  if (w.waitsBlockHost) {
    scaleCompute(w, factor);
    return;
  }
  for (GraphRun& run : w.runs) {
    for (std::vector<double>* times : {&run.hostUs, &run.issueUs}) {
      for (double& t : *times) t *= factor;
    }
  }
  w.optimizerHostUs *= factor;
  w.recordedHostUs *= factor;
}

void scaleDevice(Workload& w, double factor) {
  for (GraphRun& run : w.runs) {
    for (std::vector<double>* times : {&run.computeUs, &run.opDeviceUs}) {
      for (double& t : *times) t *= factor;
    }
  }
  w.optimizerUs *= factor;
}

void applyReplayFit(Workload& w, std::optional<double> hostScale, std::optional<double> deviceScale) {
  if (hostScale) scaleHost(w, *hostScale);
  if (deviceScale) scaleDevice(w, *deviceScale);
}

Workload makeWorkload(const schemas::Trace& trace, int64_t worldSize, StepReplay replay) {
  if (trace.steps.empty()) throw std::invalid_argument("/steps: the trace has no step to plan from");
  Workload w = workloadShape(trace, worldSize);
  const size_t end = detail::steadyOptimizerStep(trace, w.gradAccumSteps, replay, w.stepChoice);
  const std::vector<size_t> micro = detail::microStepsEndingAt(trace, end, w.gradAccumSteps);
  w.traceStep = trace.steps[end].index;
  chooseTimes(w, trace, end, micro, replay);
  std::unordered_map<int64_t, int32_t> runsOfGraph;
  RecordedHoldings recorded(w, trace);
  for (size_t m = 0; m < micro.size(); ++m) {
    const bool sync = m + 1 == micro.size();  // the micro-step the optimizer step follows
    const schemas::TraceStep& step = trace.steps[micro[m]];
    const size_t first = w.runs.size();
    for (size_t gi = 0; gi < step.graphs.size(); ++gi) {
      const schemas::TraceGraph& tg = step.graphs[gi];
      const std::string ptr = "/steps/" + std::to_string(micro[m]) + "/graphs/" + std::to_string(gi);
      w.runs.push_back(readRun(w, tg, ptr, runsOfGraph[tg.id]++, trace.memory.baselineBytes, recorded, sync));
    }
    pairSavedActivations(w, step, "/steps/" + std::to_string(micro[m]), first);
  }
  markLastReleases(w);
  if (w.gradAccumSteps == 1) {  // each recorded step follows an optimizer step
    for (const schemas::TraceStep& step : trace.steps) {
      if (step.graphs.empty() || step.graphs.front().events.empty()) continue;
      const schemas::OpEvent& first = step.graphs.front().events.front();
      w.leastOptimizerExcessBytes =
          std::min(w.leastOptimizerExcessBytes,
                   first.peakBytes > first.memoryBytes ? first.peakBytes - first.memoryBytes : 0);
    }
  }
  scaleOptimizerToShards(w);
  return w;
}

}  // namespace dcplan::planner
