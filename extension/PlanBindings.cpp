// dcplan._C: plan replay (loading a plan against the live model) and the replay log.
#include "Bindings.h"

#include "dcplan/recorder/Probes.h"
#include "dcplan/replayer/Plan.h"
#include "dcplan/replayer/Runtime.h"
#include "dcplan/schemas/io.h"
#include "dcplan/schemas/replay_log.h"

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;
using namespace dcplan::replayer;

namespace dcplan::extension {

namespace {

/// The graphs of a plan (JSON text; `name` in errors) as a replay follows them: a list of
/// (graph id, backward, [(position, ds_ids)] in launch order, buckets in ready order).
py::list followedGraphsOf(const std::string& text, const std::string& name,
                          const std::vector<int64_t>& frozen) {
  schemas::Plan plan;
  try {
    const std::vector<schemas::Diagnostic> problems =
        schemas::validatePlan(schemas::parseJson(text, name), plan);
    if (!problems.empty()) throw schemas::InputError(name, problems);
  } catch (const schemas::InputError& e) {
    throw py::value_error(e.what());
  }
  py::list out;
  for (const CursorGraph& g : followedGraphs(plan, std::set<int64_t>(frozen.begin(), frozen.end()))) {
    py::list groups;
    for (const auto& [position, ids] : g.groups) {
      for (const CursorGroup& group : ids) groups.append(py::make_tuple(position, group.dsIds));
    }
    py::list ends;
    for (const auto& [position, id] : g.persistentEnds) ends.append(py::make_tuple(position, id));
    out.append(py::make_tuple(g.id, g.backward, groups, g.buckets, ends));
  }
  return out;
}

/// A replay log's events as the step rule reads them (dcplan/schemas/replay_log.h).
std::vector<schemas::ReplayLogEvent> stepEvents(
    const std::vector<std::tuple<std::string, int64_t, bool, bool>>& events) {
  std::vector<schemas::ReplayLogEvent> out;
  out.reserve(events.size());
  for (const auto& [ev, tUs, sync, grad] : events) out.push_back({ev, tUs, sync, grad});
  return out;
}

}  // namespace

void bindPlan(py::module_& m) {
  m.def("followed_graphs", &followedGraphsOf, py::arg("plan_json"), py::arg("name"), py::arg("frozen"),
        "A plan's graphs as the plan cursor follows them: (graph id, backward, [(position, ds_ids)] in "
        "launch order, buckets in gradient-ready order, [(position, ds_id)] where persistent copies end before "
        "a step, without the frozen parameters); ValueError naming "
        "the plan for an invalid one.");
  // params: (ds_id, name, shape, dtype name, trainable) per parameter.
  using ParamTuple = std::tuple<int64_t, std::string, std::vector<int64_t>, std::string, bool>;
  auto liveModel = [](const std::vector<ParamTuple>& params, int64_t worldSize) {
    LiveModel model;
    for (const auto& [id, name, shape, dtype, trainable] : params) {
      model.params.push_back(LiveParam{id, name, shape, dtype, trainable});
    }
    model.worldSize = worldSize;
    return model;
  };
  m.def(
      "param_signature",
      [liveModel](const std::vector<ParamTuple>& params, int64_t worldSize) {
        return liveSignature(liveModel(params, worldSize));
      },
      py::arg("params"), py::arg("world_size"),
      "The parameter signature (docs/formats.md) of (ds_id, name, shape, dtype, trainable) tuples.");
  m.def(
      "load_plan",
      [liveModel](const std::string& path, const std::vector<ParamTuple>& params, int64_t worldSize,
                  int64_t stage, int64_t forwardGraph, int64_t backwardGraph, const std::string& reduceDtype,
                  const py::object& gatherDtype, const std::string& onMismatch, bool compiled) {
        LiveModel model = liveModel(params, worldSize);
        model.stage = stage;
        model.forwardGraph = forwardGraph;
        model.backwardGraph = backwardGraph;
        model.reduceDtype = reduceDtype;
        model.gatherDtype = optionalDtype(gatherDtype, "load_plan: gather_dtype");
        model.compiled = compiled;
        TORCH_CHECK(onMismatch == "error" || onMismatch == "fallback",
                    "load_plan: on_mismatch should be \"error\" or \"fallback\", got \"", onMismatch, "\"");
        PlanSummary summary;
        try {
          py::gil_scoped_release noGil;
          summary = loadPlan(path, model, onMismatch == "error" ? OnMismatch::Error : OnMismatch::Fallback);
        } catch (const PlanError& e) {
          throw py::value_error(e.what());
        }
        py::dict out;
        out["signature"] = summary.signature;
        out["persistent"] = summary.persistent;
        out["prefetch_groups"] = summary.prefetchGroups;
        out["cuda_graph"] = summary.cudaGraph;
        out["buckets"] = summary.buckets;
        out["optimizer_offload"] = summary.optimizerOffload;
        out["optimizer_offload_bytes"] = summary.optimizerOffloadBytes;
        out["master_offload"] = summary.masterOffload;
        out["offload_state_bytes"] = summary.offloadStateBytes;
        out["offload_master_bytes"] = summary.offloadMasterBytes;
        out["memory_budget_bytes"] = summary.memoryBudgetBytes
                                         ? py::object(py::int_(*summary.memoryBudgetBytes))
                                         : py::object(py::none());
        out["guard_start_bytes"] =
            summary.guardStartBytes ? py::object(py::int_(*summary.guardStartBytes)) : py::object(py::none());
        out["input_shapes"] = summary.inputShapes ? py::cast(*summary.inputShapes) : py::object(py::none());
        py::list saves;
        for (const schemas::OffloadedSave& o : summary.offloadSaves)
          saves.append(py::make_tuple(o.pack, o.bytes));
        out["offload_saves"] = saves;
        out["offload_saves_pointer"] = summary.offloadSavesPointer;
        return out;
      },
      py::arg("path"), py::arg("params"), py::arg("world_size"), py::arg("stage"), py::arg("forward_graph"),
      py::arg("backward_graph"), py::arg("reduce_dtype"), py::arg("gather_dtype") = py::none(),
      py::arg("on_mismatch") = "error", py::arg("compiled") = false,
      "Reads plan file path, checks it against the live model (ValueError naming the file, the JSON "
      "pointer and what differs) and makes it the runtime's schedule.");
  m.def(
      "set_replay_log",
      [](const std::string& path, const std::optional<std::string>& device) {
        MemoryGauge gauge;
        if (device) {
          // DCPLAN_REPLAY_LOG_PEAKS=1 on a GPU: per-op peaks too, from the allocator's peak
          // statistic, reset at every op (torch.cuda.max_memory_allocated() then covers one op).
          const char* peaks = std::getenv("DCPLAN_REPLAY_LOG_PEAKS");
          const bool devicePeaks =
              !c10::Device(*device).is_cpu() && peaks != nullptr && std::string(peaks) == "1";
          std::shared_ptr<dcplan::recorder::MemoryProbe> probe =
              devicePeaks ? dcplan::recorder::makeDeviceAllocatorProbe(c10::Device(*device))
                          : dcplan::recorder::makeReplayOpProbe(c10::Device(*device));
          const bool windowPeak = c10::Device(*device).is_cpu() || devicePeaks;
          gauge = [probe, windowPeak] {
            OpMemory m;
            m.inUse = static_cast<int64_t>(probe->bytesInUse());
            if (windowPeak) m.peakBefore = static_cast<int64_t>(probe->takePeakBytes());
            return m;
          };
        }
        // On CPU ranks the host is the device: the log's host work lengthens the step by all of it.
        const LogRank who = isInitialized() ? LogRank{rank(), worldSize()} : LogRank{};
        setReplayLog(path, std::move(gauge), device && c10::Device(*device).is_cpu(), who);
      },
      py::arg("path"), py::arg("device") = std::nullopt, py::call_guard<py::gil_scoped_release>(),
      "Writes this rank's replay log (JSON lines) to path from now on; '' stops. With device "
      "('cpu', 'cuda:N'), each op line carries the memory in use there (and on the CPU the peak "
      "since the op before).");
  m.def("set_budget_guard", &setBudgetGuard, py::arg("budget_bytes"), py::arg("start_bytes") = 0,
        py::call_guard<py::gil_scoped_release>(),
        "The budget guard (docs/replay.md): a planned prefetch or persistent copy whose planned peak plus "
        "what the run holds beyond the plan's model (set_budget_guard_excess) would exceed budget_bytes is "
        "not taken; start_bytes: the plan's guard.start_bytes. None: no guard.");
  m.def("set_budget_guard_excess", &setBudgetGuardExcess, py::arg("excess_bytes"),
        py::call_guard<py::gil_scoped_release>(),
        "What the ranks agreed they hold beyond the plan's model at a step's start; the guard acts from now "
        "on.");
  m.def(
      "take_budget_guard_note",
      [] {
        std::string msg = takeBudgetGuardNote();
        return msg.empty() ? py::object(py::none()) : py::object(py::str(msg));
      },
      "A message about the budget guard's first hold, once; None otherwise.");
  m.def(
      "replay_step_starts",
      [](const std::vector<std::tuple<std::string, int64_t, bool, bool>>& events) {
        return schemas::stepStarts(stepEvents(events));
      },
      py::arg("events"),
      "The t_us of each optimizer step's start in a replay log's (ev, t_us, sync, grad) events "
      "(dcplan/schemas/replay_log.h).");
  m.def(
      "replay_steps",
      [](const std::vector<std::tuple<std::string, int64_t, bool, bool>>& events) {
        const schemas::MeasuredSteps m = schemas::measuredSteps(schemas::stepStarts(stepEvents(events)));
        return py::make_tuple(m.medianUs ? py::object(py::float_(*m.medianUs)) : py::object(py::none()),
                              m.count);
      },
      py::arg("events"),
      "(median step in us or None, intervals timed) of a replay log's (ev, t_us, sync, grad) events: the "
      "step "
      "rule of dcplan check and dcplan plan --calibrate.");
  m.def(
      "replay_graph_step",
      [](const std::vector<std::pair<std::string, double>>& events) {
        std::vector<schemas::ReplayLogEvent> out;
        out.reserve(events.size());
        for (const auto& [ev, deviceUs] : events) out.push_back({ev, 0, true, true, deviceUs});
        const schemas::MeasuredGraphReplays m = schemas::measuredGraphReplays(out);
        const py::object stepUs = m.stepUs ? py::object(py::float_(*m.stepUs)) : py::object(py::none());
        return py::make_tuple(stepUs, m.timed());
      },
      py::arg("events"),
      "(step in us or None, replays timed) of a replay log's (ev, device_us) events: a graphed step's "
      "rule of dcplan check and dcplan plan --calibrate (dcplan/schemas/replay_log.h).");
  m.def(
      "graph_step_us",
      [](std::vector<double> replayUs) {
        const std::optional<double> us = schemas::graphStepUs(std::move(replayUs));
        return us ? py::object(py::float_(*us)) : py::object(py::none());
      },
      py::arg("replay_us"),
      "A captured step's time from its replays' device times in order, or None with too few: the rule of "
      "the recorder's calibration.graph_step_us, dcplan check and dcplan plan --calibrate "
      "(dcplan/schemas/replay_log.h).");
  m.attr("GRAPH_TIMED_REPLAYS") = schemas::kGraphTimedReplays;
  m.def("input_shapes_text", &schemas::inputShapesText, py::arg("shapes"),
        "Input shapes as inspect, diff and the replay's warning print them: \"[(2, 64), (2,)]\".");
  m.def("flush_replay_log", &flushReplayLog, py::call_guard<py::gil_scoped_release>());
  m.def(
      "replay_log_clock",
      [] {
        const ReplayLogClock c = replayLogClock();
        return std::make_tuple(c.tUs, c.costUs, c.ownTimeLeftOut);
      },
      py::call_guard<py::gil_scoped_release>(),
      "(t_us, log_us, left_out): the replay log's clock now as its op lines read it, the log's own host time "
      "since it opened, and whether t_us leaves that out (CPU ranks).");
  m.def("log_replay_event", &logReplayEvent, py::arg("json"), py::call_guard<py::gil_scoped_release>(),
        "Appends one JSON object (one line) to this rank's replay log, if one is open.");
  m.def("plan_active", &planActive, "Whether a loaded plan drives the schedule (no departure so far).");
  m.def(
      "take_plan_departure",
      [] {
        std::string msg = takePlanDeparture();
        return msg.empty() ? py::object(py::none()) : py::object(py::str(msg));
      },
      "The message of a departure from the plan under on_mismatch='fallback', once; None otherwise.");
}

}  // namespace dcplan::extension
