// Plan reports for `dcplan inspect`: summary, per-layer table, Chrome trace of the simulated step.
#include "dcplan/planner/report.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <vector>

#include <nlohmann/json.hpp>

#include "dcplan/planner/diff.h"
#include "dcplan/planner/in_situ.h"
#include "dcplan/planner/planner.h"
#include "dcplan/planner/simulator.h"
#include "dcplan/planner/units.h"
#include "dcplan/schemas/io.h"
#include "dcplan/schemas/units.h"

namespace dcplan::planner {
namespace {

using schemas::formatBytes;
using schemas::formatMs;

std::string pad(const std::string& s, size_t width, bool right = false) {
  if (s.size() >= width) return s;
  return right ? std::string(width - s.size(), ' ') + s : s + std::string(width - s.size(), ' ');
}

/// The module a parameter belongs to, at layer granularity: the name up to its
/// first numeric component ("layers.3.attn.wq.weight" -> "layers.3"), else the
/// name without its last component ("embed.weight" -> "embed").
std::string layerOf(const std::string& name) {
  size_t start = 0;
  while (start < name.size()) {
    size_t dot = name.find('.', start);
    std::string part = name.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) {
      return std::isdigit(static_cast<unsigned char>(c));
    });
    if (numeric) return name.substr(0, dot == std::string::npos ? name.size() : dot);
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  size_t last = name.rfind('.');
  return last == std::string::npos ? name : name.substr(0, last);
}

struct Simulated {
  Workload w;
  SimResult plan;
  SimResult def;
  std::optional<InSituFit> inSitu;
  std::optional<double> hostScale;    ///< the plan's options.host_scale
  std::optional<double> deviceScale;  ///< the plan's options.device_scale
  std::optional<CapturedStep> captured;
};

Simulated simulatePlan(const schemas::Plan& plan, const schemas::Trace& trace) {
  const schemas::Network* network = plan.options.network ? &plan.options.network->measured : nullptr;
  std::optional<CapturedStep> captured;
  Workload w =
      plannedWorkload(trace, plan.source.worldSize, plannedReplay(plan.options), network, nullptr, &captured);
  applyReplayFit(w, plan.options.hostScale, plan.options.deviceScale);
  std::optional<InSituFit> inSitu;
  CostModel cost =
      plannedCostModel(trace, w, plan.options.bandwidthGBps, network, plan.options.inSituScale, &inSitu);
  const CompiledSchedule def = compileSchedule(w, defaultSchedule(w));
  const SimResult recorded = simulate(w, cost, def, SimOptions{true});
  SimResult p = simulate(w, cost, compileSchedule(w, scheduleOf(plan)), againstRecorded(recorded, true));
  SimResult d = replayedDefault(w, cost, def, recorded, true);
  return Simulated{std::move(w), std::move(p),       std::move(d),
                   inSitu,       plan.options.hostScale, plan.options.deviceScale,
                   captured};
}

std::string count(size_t n, const std::string& noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}

std::string budgetText(const schemas::Plan& plan) {
  return plan.options.memoryBudgetBytes ? formatBytes(*plan.options.memoryBudgetBytes)
                                        : "none (device capacity)";
}

}  // namespace

void checkPlanMatchesTrace(const schemas::Plan& plan, const schemas::Trace& trace) {
  std::string sig = schemas::paramSignature(trace.params, plan.source.worldSize);
  if (sig != plan.source.paramSignature) {
    throw std::invalid_argument("/source/param_signature: the plan was made for another model (" +
                                plan.source.paramSignature + ") than the trace has at world size " +
                                std::to_string(plan.source.worldSize) + " (" + sig + ")");
  }
}

namespace {

void renderHeader(std::ostream& s, const schemas::Plan& plan, const std::string& planName) {
  s << "plan:     " << planName << " (" << schemas::kPlanSchema << ", " << plan.createdBy << ")\n"
    << "made for: " << (plan.source.trace.empty() ? "?" : plan.source.trace) << " ("
    << plan.source.traceDigest << "), " << plan.source.worldSize << " ranks, ZeRO-" << plan.source.stage
    << ", grad accum " << plan.options.gradAccumSteps
    << (plan.source.replay == "compiled" ? ", compiled" : "")
    << (plan.options.cudaGraph ? ", one CUDA graph per step" : "") << "\n"
    << "options:  strategy " << plan.options.strategy << ", memory budget " << budgetText(plan)
    << ", bandwidth "
    << (plan.options.bandwidthGBps ? formatFixed(*plan.options.bandwidthGBps, 1) + " GB/s"
                                   : std::string("as calibrated"))
    << "\n";
  if (const auto& n = plan.options.network) {
    s << "network:  " << n->file << ": collectives measured on " << n->measured.worldSize << " ranks ("
      << n->measured.backend << ", " << n->measured.device
      << "), planned with instead of the trace's calibration\n";
  }
}

/// The plan's schedule in a few lines: persistence, and per graph its prefetch groups and buckets.
void renderSchedule(std::ostream& s, const schemas::Plan& plan) {
  s << "\nschedule:\n  persistent: " << count(plan.persistent.size(), "param");
  if (!plan.persistent.empty()) s << " [" << formatIds(plan.persistent) << "]";
  s << "\n";
  for (const schemas::PlanGraph& g : plan.graphs) {
    size_t ids = 0, largest = 0;
    for (const auto& p : g.prefetch) {
      ids += p.dsIds.size();
      largest = std::max(largest, p.dsIds.size());
    }
    uint64_t bytes = 0, biggest = 0;
    for (const auto& b : g.buckets) {
      bytes += b.bytes;
      biggest = std::max(biggest, b.bytes);
    }
    s << "  graph " << g.id << " (" << schemas::graphKindName(g.kind)
      << "): " << count(g.prefetch.size(), "prefetch group");
    if (!g.prefetch.empty()) s << " (" << count(ids, "gather") << ", up to " << largest << " fused)";
    if (!g.buckets.empty()) {
      s << ", " << count(g.buckets.size(), "bucket") << " (" << formatBytes(bytes) << ", largest "
        << formatBytes(biggest) << ")";
    }
    if (const size_t ends = g.persistentEnds.size(); ends > 0) {  // the plan's persistent_ends
      s << ", " << ends << (ends == 1 ? " persistent copy ends" : " persistent copies end")
        << " at the last release before the step";
    }
    if (g.inputShapes) s << ", recorded inputs " << schemas::inputShapesText(*g.inputShapes);
    s << "\n";
  }
  if (!plan.optimizerOffload.empty()) {
    size_t ids = 0, masterIds = 0;
    uint64_t bytes = 0, masterBytes = 0;
    for (const auto& g : plan.optimizerOffload) {
      ids += g.dsIds.size();
      bytes += g.bytes;
      if (g.masterBytes > 0) masterIds += g.dsIds.size();
      masterBytes += g.masterBytes;
    }
    const schemas::Prediction& p = plan.predicted;
    s << "  offload: optimizer state of " << count(ids, "param") << " on the host between steps ("
      << formatBytes(bytes) << ", " << count(plan.optimizerOffload.size(), "group") << ")";
    if (masterIds > 0) {
      s << "; master shards of " << count(masterIds, "param") << " on the host between uses ("
        << formatBytes(masterBytes) << ", brought back for each gather and their update)";
    }
    s << "; per step " << formatMs(p.reloadUs) << " of copies in, " << formatMs(p.offloadUs) << " out, "
      << formatMs(std::max(0.0, p.reloadUs + p.offloadUs - p.exposedCopyUs)) << " of it beside other "
      << "work, " << formatMs(p.exposedCopyUs) << " added to the step\n";
  }
  size_t saves = 0;
  for (const auto& g : plan.graphs) saves += g.offloadSaves.size();
  if (saves > 0) {
    const schemas::Prediction& p = plan.predicted;
    s << "  offload: " << count(saves, "saved activation")
      << " on the host from their save until the backward "
      << "reads them (" << formatBytes(p.activationOffloadBytes) << " a step); their copies, "
      << formatMs(p.activationCopyUs) << " a step both ways, run on the compute stream\n";
  }
  const std::string bound = copyBoundLine(plan.predicted);
  if (!bound.empty()) s << "  " << bound << "\n";
}

/// The plan's predicted step, exposed communication and peak against the default schedule's.
void renderPrediction(std::ostream& s, const schemas::Plan& plan) {
  const schemas::Prediction& p = plan.predicted;
  const schemas::Prediction& d = plan.predictedDefault;
  s << "\nprediction:      step   exposed comm    peak memory\n"
    << "  plan     " << pad(formatMs(p.stepUs), 12, true) << pad(formatMs(p.exposedCommUs), 15, true)
    << pad(formatBytes(p.peakMemoryBytes), 15, true) << "\n"
    << "  default  " << pad(formatMs(d.stepUs), 12, true) << pad(formatMs(d.exposedCommUs), 15, true)
    << pad(formatBytes(d.peakMemoryBytes), 15, true) << "\n"
    << "  change   " << pad(formatChange(d.stepUs, p.stepUs), 12, true)
    << pad(formatChange(d.exposedCommUs, p.exposedCommUs), 15, true)
    << pad(formatChange(static_cast<double>(d.peakMemoryBytes), static_cast<double>(p.peakMemoryBytes)), 15,
           true)
    << "\n";
}

/// The plan simulated again on `traceName`, and which lane bounds the step.
void renderSimulated(std::ostream& s, const Simulated& sim, const std::string& traceName) {
  const Workload& w = sim.w;
  const schemas::Prediction& again = sim.plan.prediction;
  s << "  simulated on " << traceName << ": step " << formatMs(again.stepUs) << ", exposed comm "
    << formatMs(again.exposedCommUs) << ", peak " << formatBytes(again.peakMemoryBytes) << "\n";
  if (w.cudaGraph) {
    s << "  host lane: none (planned for a CUDA graph's replay: the device's own times)\n";
    if (sim.captured) s << "  " << capturedStepText(*sim.captured) << "\n";
  } else if (w.hostLane) {
    const bool hostBound = sim.plan.hostUs >= again.stepUs - 1.0;  // within 1 us: the host ends the step
    s << "  host lane: the host issues the step in " << formatMs(sim.plan.hostUs) << "; "
      << (hostBound ? "host-bound (the device waits for the host)" : "the device bounds the step")
      << (w.ownDeviceTimes ? "; the device on its own times (the recording's device-lead step)" : "") << "\n";
  } else {
    s << "  host lane: none (the trace has no host times; the step is simulated on the device's times)\n";
  }
  if (sim.inSitu) s << "  " << inSituText(*sim.inSitu) << "\n";
  if (sim.hostScale) {
    s << "  host: every host time at " << formatFixed(*sim.hostScale, 2)
      << "x the recording's, the pace the plan was calibrated to (options.host_scale)\n";
  }
  if (sim.deviceScale) {
    s << "  device: every device time at " << formatFixed(*sim.deviceScale, 3)
      << "x the trace's (after its captured-step fit, where it has one), as the plan was calibrated to "
         "a replay of its graph (options.device_scale)\n";
  }
  if (sim.plan.checkUs > 0) {  // the replay checks each call with the other ranks (docs/planning.md)
    s << "  agreement checks: " << formatMs(sim.plan.checkUs) << " a step on the host, one before each of "
      << count(static_cast<size_t>(sim.plan.calls()), "collective call")
      << " (the default schedule: " << formatMs(sim.def.checkUs) << ", "
      << count(static_cast<size_t>(sim.def.calls()), "call") << ")\n";
  }
}

/// One row of the per-layer table: gathers per step, how far ahead they were issued,
/// persistence, buckets.
struct LayerRow {
  std::string name;
  size_t params = 0;
  uint64_t bytes = 0;
  int64_t gathers = 0;
  int64_t aheadFwd = -1, aheadBwd = -1;
  size_t persistent = 0;
  std::vector<int64_t> buckets;
};

std::vector<LayerRow> layerRows(const schemas::Plan& plan, const Simulated& sim) {
  const Workload& w = sim.w;
  std::vector<LayerRow> layers;
  std::map<std::string, size_t> index;
  std::vector<size_t> layerOfParam(w.params.size());
  std::vector<size_t> order(w.params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return w.params[a].id < w.params[b].id; });
  std::vector<char> persistent(w.params.size(), 0);
  for (int64_t id : plan.persistent) {
    int32_t pi = w.paramIndex(id);
    if (pi >= 0) persistent[static_cast<size_t>(pi)] = 1;
  }
  for (size_t pi : order) {
    std::string name = layerOf(w.params[pi].name);
    auto [it, fresh] = index.emplace(name, layers.size());
    if (fresh) {
      layers.emplace_back();
      layers.back().name = name;
    }
    LayerRow& l = layers[it->second];
    l.params++;
    l.bytes += w.params[pi].gatherBytes;
    l.persistent += persistent[pi] ? 1 : 0;
    layerOfParam[pi] = it->second;
  }
  for (const GatherRecord& g : sim.plan.gathers) {
    const GraphRun& run = w.runs[static_cast<size_t>(g.run)];
    const WorkGraph& graph = w.graphs[static_cast<size_t>(run.graph)];
    for (int32_t p : g.params) {
      LayerRow& l = layers[layerOfParam[static_cast<size_t>(p)]];
      l.gathers++;
      // Distance in ops from the issue to the parameter's first user.
      int64_t ahead = 0;
      for (const WorkOp& op : graph.ops) {
        if (op.seq >= g.issueSeq && op.param == p && op.role == OpRole::GatherWait) {
          ahead = op.seq - g.issueSeq;
          break;
        }
      }
      int64_t& slot = graph.kind == schemas::GraphKind::Forward ? l.aheadFwd : l.aheadBwd;
      slot = std::max(slot, ahead);
    }
  }
  for (const schemas::PlanGraph& g : plan.graphs) {
    for (size_t b = 0; b < g.buckets.size(); ++b) {
      for (int64_t id : g.buckets[b].dsIds) {
        int32_t pi = w.paramIndex(id);
        if (pi < 0) continue;
        auto& list = layers[layerOfParam[static_cast<size_t>(pi)]].buckets;
        if (std::find(list.begin(), list.end(), static_cast<int64_t>(b)) == list.end())
          list.push_back(static_cast<int64_t>(b));
      }
    }
  }
  return layers;
}

void renderLayers(std::ostream& s, std::vector<LayerRow> layers) {
  size_t width = 5;
  for (const LayerRow& l : layers) width = std::max(width, l.name.size());
  s << "\nper layer (simulated):\n  " << pad("layer", width)
    << "  params   gathered  gathers/step  ahead fwd/bwd"
    << "  persistent  buckets\n";
  auto ahead = [](int64_t v) { return v < 0 ? std::string("-") : std::to_string(v); };
  for (LayerRow& l : layers) {
    std::sort(l.buckets.begin(), l.buckets.end());
    s << "  " << pad(l.name, width) << pad(std::to_string(l.params), 8, true)
      << pad(formatBytes(l.bytes), 11, true) << pad(std::to_string(l.gathers), 14, true)
      << pad(ahead(l.aheadFwd) + "/" + ahead(l.aheadBwd), 15, true)
      << pad(std::to_string(l.persistent) + "/" + std::to_string(l.params), 12, true) << "  "
      << (l.buckets.empty() ? "-" : formatIds(l.buckets)) << "\n";
  }
  s << "  (ahead: most ops between a gather's issue and its first user; gathers/step counts parameters "
       "gathered)\n";
}

}  // namespace

std::string renderPlanReport(const schemas::Plan& plan, const std::string& planName,
                             const schemas::Trace* trace, const std::string& traceName) {
  std::ostringstream s;
  renderHeader(s, plan, planName);
  if (trace) {
    checkPlanMatchesTrace(plan, *trace);
    if (schemas::traceDigest(*trace) != plan.source.traceDigest) {
      s << "note:     " << traceName << " is another trace of the same model ("
        << schemas::traceDigest(*trace) << "); the timeline below is simulated on it\n";
    }
  }
  renderSchedule(s, plan);
  renderPrediction(s, plan);
  if (!trace) {
    s << "\n(pass --trace TRACE for the per-layer table and --chrome-trace OUT.json for the timeline)\n";
    return s.str();
  }
  const Simulated sim = simulatePlan(plan, *trace);
  renderSimulated(s, sim, traceName);
  renderLayers(s, layerRows(plan, sim));
  return s.str();
}

std::string renderChromeTrace(const schemas::Plan& plan, const std::string& planName,
                              const schemas::Trace& trace) {
  using nlohmann::ordered_json;
  checkPlanMatchesTrace(plan, trace);
  Simulated sim = simulatePlan(plan, trace);
  std::vector<ordered_json> events;
  auto meta = [&](int pid, int tid, const char* what, const std::string& name) {
    ordered_json e;
    e["name"] = what;
    e["ph"] = "M";
    e["pid"] = pid;
    if (tid >= 0) e["tid"] = tid;
    e["args"] = {{"name", name}};
    events.push_back(std::move(e));
  };
  auto emit = [&](int pid, const SimResult& r) {
    for (Stream st : {Stream::Compute, Stream::AllGather, Stream::Reduce, Stream::Copy}) {
      meta(pid, static_cast<int>(st) + 1, "thread_name", streamName(st));
    }
    if (!plan.optimizerOffload.empty()) {  // the planned offload's copy streams, each way
      for (Stream st : {Stream::Reload, Stream::Offload}) {
        meta(pid, static_cast<int>(st) + 1, "thread_name", streamName(st));
      }
    }
    for (const TimelineEvent& t : r.timeline) {
      const GraphRun& run = sim.w.runs[static_cast<size_t>(t.run)];
      const WorkGraph& g = sim.w.graphs[static_cast<size_t>(run.graph)];
      std::string name = t.name;
      if (t.name == "compute") name = std::string(schemas::graphKindName(g.kind)) + " compute";
      if (!t.dsIds.empty()) name += " [" + formatIds(t.dsIds) + "]";
      ordered_json e;
      e["name"] = name;
      e["cat"] = streamName(t.stream);
      e["ph"] = "X";
      e["pid"] = pid;
      e["tid"] = static_cast<int>(t.stream) + 1;
      e["ts"] = std::round(t.startUs * 1000) / 1000;
      e["dur"] = std::round((t.endUs - t.startUs) * 1000) / 1000;
      ordered_json args;
      if (t.name != "optimizer") {
        args["graph"] = g.id;
        args["micro_step"] = run.microStep;
        args["seq"] = t.seq;
      }
      if (!t.dsIds.empty()) args["ds_ids"] = t.dsIds;
      if (t.bytes) args["bytes"] = t.bytes;
      if (!args.empty()) e["args"] = std::move(args);
      events.push_back(std::move(e));
    }
    uint64_t last = UINT64_MAX;
    for (const MemorySample& m : r.memory) {
      if (m.bytes == last) continue;
      last = m.bytes;
      ordered_json e;
      e["name"] = "memory";
      e["ph"] = "C";
      e["pid"] = pid;
      e["ts"] = std::round(m.us * 1000) / 1000;
      e["args"] = {{"bytes", m.bytes}};
      events.push_back(std::move(e));
    }
  };
  meta(1, -1, "process_name", "plan " + planName + " (" + plan.options.strategy + ")");
  meta(2, -1, "process_name", "default schedule");
  emit(1, sim.plan);
  emit(2, sim.def);
  std::string out = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  for (size_t i = 0; i < events.size(); ++i) out += events[i].dump() + (i + 1 < events.size() ? ",\n" : "\n");
  out += "]}\n";
  return out;
}

std::string renderMemoryCurve(const schemas::Plan& plan, const std::string& planName,
                              const schemas::Trace& trace) {
  using nlohmann::ordered_json;
  checkPlanMatchesTrace(plan, trace);
  Simulated sim = simulatePlan(plan, trace);
  // Both samples of an op, keyed by (run, seq), in op order.
  std::map<std::pair<int32_t, int64_t>, std::pair<uint64_t, uint64_t>> ops;  // before, at
  std::map<std::pair<int32_t, int64_t>, double> entered;                     // the host at the op
  for (const MemorySample& m : sim.plan.memory) {
    if (m.run < 0 || m.seq < 0) continue;
    auto& entry = ops[{m.run, m.seq}];
    (m.atOp ? entry.second : entry.first) = m.bytes;
    if (!m.atOp) entered[{m.run, m.seq}] = m.hostUs;
  }
  ordered_json samples = ordered_json::array();
  for (const auto& [key, bytes] : ops) {
    const GraphRun& run = sim.w.runs[static_cast<size_t>(key.first)];
    const WorkGraph& g = sim.w.graphs[static_cast<size_t>(run.graph)];
    const auto& events = trace.steps.back().graphs;  // op names: any recorded run of the graph
    std::string opName;
    for (const schemas::TraceGraph& tg : events) {
      if (tg.id == g.id && static_cast<size_t>(key.second) < tg.events.size()) {
        opName = tg.events[static_cast<size_t>(key.second)].op;
      }
    }
    samples.push_back({{"graph", g.id},
                       {"kind", schemas::graphKindName(g.kind)},
                       {"micro_step", run.microStep},
                       {"pos", key.second},
                       {"op", opName},
                       {"before_bytes", bytes.first},
                       {"at_bytes", bytes.second},
                       {"host_us", std::round(entered[key] * 1e3) / 1e3}});
  }
  ordered_json doc;
  doc["plan"] = planName;
  doc["trace_step"] = sim.w.traceStep;
  doc["peak_memory_bytes"] = sim.plan.prediction.peakMemoryBytes;
  doc["step_us"] = std::round(sim.plan.prediction.stepUs * 1e3) / 1e3;
  doc["host_lane"] = sim.w.hostLane;  // host_us is the host's clock; without a lane, the device's
  doc["samples"] = std::move(samples);
  return doc.dump(1) + "\n";
}

std::string copyBoundLine(const schemas::Prediction& p) {
  if (p.copyBoundUs <= 0) return "";
  std::ostringstream s;
  s << "copy bound: " << formatMs(p.copyBoundUs) << ", the longest of the plan without a budget ("
    << (p.unconstrainedStepUs > 0 ? formatMs(p.unconstrainedStepUs) : std::string("none fits the device"))
    << ") and every copy a step at the planned host-link rates (in " << formatMs(p.copyInUs) << ", out "
    << formatMs(p.copyOutUs) << "); the plan's step " << formatMs(p.stepUs) << " is "
    << formatFixed(p.stepUs / p.copyBoundUs, 2) << "x it";
  return s.str();
}

}  // namespace dcplan::planner
