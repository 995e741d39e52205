// `dcplan plan TRACE -o PLAN`: plans a trace's communication and writes the plan.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "dcplan/planner/planner.h"
#include "dcplan/planner/report.h"
#include "dcplan/planner/units.h"
#include "dcplan/schemas/io.h"
#include "dcplan/schemas/network.h"
#include "dcplan/schemas/replay_log.h"
#include "subcommands.h"

namespace dcplan::cli {
namespace {

struct PlanCliOptions {
  std::string trace;
  std::string output;
  std::string memoryBudget;
  std::string strategy = "optimized";
  int64_t worldSize = 0;
  std::string bandwidth;
  bool explain = false;
  bool cudaGraph = false;
  bool noCudaGraph = false;
  std::vector<std::string> calibrate;  ///< replay logs of an earlier plan's replay
  std::string network;                 ///< a dcplan.network/v1 file
};

/// The plan a replay log names: as the job gave it, or, relative and not found from here, beside
/// the log. InputError naming the log where it cannot be read.
schemas::Plan replayedPlan(const std::string& log, const std::string& planFile) {
  std::filesystem::path path(planFile);
  if (path.is_relative() && !std::filesystem::exists(path)) {
    const std::filesystem::path beside = std::filesystem::path(log).parent_path() / path;
    if (std::filesystem::exists(beside)) path = beside;
  }
  try {
    return schemas::readPlan(path);
  } catch (const schemas::InputError& e) {
    throw schemas::InputError(log, {{"", "--calibrate: the log replayed " + planFile +
                                             ", which cannot be read as a plan: " + e.what()}});
  }
}

/// One replay log as --calibrate reads it: its file, the rank that wrote it (-1: not said) and
/// its median step.
struct LoggedStep {
  std::string path;
  int rank = -1;
  int worldSize = 0;
  double medianUs = 0;
};

/// The step --calibrate fits to and how many runs it came from.
struct CalibrationStep {
  double us = 0;
  size_t runs = 0;
};

/// Each run's step, its slowest rank's, from logs that name their rank: run k is each rank's k-th
/// log in the order given. One run may lack ranks; several must each have every rank's. InputError
/// naming the plan or the log that does not fit.
std::vector<double> runStepsByRank(const std::vector<LoggedStep>& logs, size_t ranks, const std::string& planFile) {
  std::vector<std::vector<double>> ofRank(ranks);
  for (const LoggedStep& l : logs) {
    if (static_cast<size_t>(l.worldSize) != ranks) {
      throw schemas::InputError(l.path, {{"", "--calibrate: written by rank " + std::to_string(l.rank) + " of " +
                                                  std::to_string(l.worldSize) + ", and " + planFile +
                                                  " is a plan for " + std::to_string(ranks) + " ranks"}});
    }
    if (static_cast<size_t>(l.rank) >= ranks) {
      throw schemas::InputError(l.path, {{"", "--calibrate: written by rank " + std::to_string(l.rank) + ", and " +
                                                  planFile + " is a plan for " + std::to_string(ranks) +
                                                  " ranks"}});
    }
    ofRank[static_cast<size_t>(l.rank)].push_back(l.medianUs);
  }
  const auto most = std::max_element(ofRank.begin(), ofRank.end(),
                                     [](const auto& a, const auto& b) { return a.size() < b.size(); });
  const size_t runs = most->size();
  for (size_t r = 0; r < ranks && runs > 1; ++r) {
    if (ofRank[r].size() != runs) {
      throw schemas::InputError(
          planFile, {{"", "--calibrate: " + std::to_string(runs) + " logs of rank " +
                              std::to_string(most - ofRank.begin()) + ", " + std::to_string(ofRank[r].size()) +
                              " of rank " + std::to_string(r) + ": give every rank's log of each run"}});
    }
  }
  std::vector<double> steps(runs, 0.0);
  for (const auto& r : ofRank) {
    for (size_t k = 0; k < r.size(); ++k) steps[k] = std::max(steps[k], r[k]);
  }
  return steps;
}

/// The same from logs that do not name their rank: one per rank of each run, run after run.
std::vector<double> runStepsByPosition(const std::vector<LoggedStep>& logs, size_t ranks,
                                       const std::string& planFile) {
  if (logs.size() > ranks && logs.size() % ranks != 0) {
    throw schemas::InputError(planFile, {{"", "--calibrate: " + std::to_string(logs.size()) +
                                                  " logs of a plan for " + std::to_string(ranks) +
                                                  " ranks: give one log per rank of each run, run after run "
                                                  "(or one run's)"}});
  }
  std::vector<double> steps;
  for (size_t first = 0; first < logs.size(); first += ranks) {
    double slowest = 0;
    for (size_t i = first; i < std::min(logs.size(), first + ranks); ++i) slowest = std::max(slowest, logs[i].medianUs);
    steps.push_back(slowest);
  }
  return steps;
}

/// The step --calibrate fits to: one run's is its slowest rank's; several runs' the median run's
/// (with an even count, the mean of the middle two), since a host's pace moves by 10-25% from
/// process to process (docs/benchmarks.md) and a fit to one run carries its luck. Logs that name
/// their rank are grouped by it; older ones by position.
CalibrationStep calibrationStep(const std::vector<LoggedStep>& logs, int64_t worldSize, const std::string& planFile) {
  const size_t ranks = static_cast<size_t>(std::max<int64_t>(1, worldSize));
  std::set<std::string> seen;
  for (const LoggedStep& l : logs) {
    if (!seen.insert(std::filesystem::weakly_canonical(l.path).string()).second) {
      throw schemas::InputError(l.path, {{"", "--calibrate: the log is given twice"}});
    }
  }
  const auto named = std::count_if(logs.begin(), logs.end(), [](const LoggedStep& l) { return l.rank >= 0; });
  if (named > 0 && static_cast<size_t>(named) < logs.size()) {
    const auto unnamed = std::find_if(logs.begin(), logs.end(), [](const LoggedStep& l) { return l.rank < 0; });
    throw schemas::InputError(unnamed->path, {{"", "--calibrate: the log does not name its rank (written by an "
                                                   "older dcplan) and others do: give logs of one kind"}});
  }
  const bool ranked = named > 0;
  std::vector<double> steps =
      ranked ? runStepsByRank(logs, ranks, planFile) : runStepsByPosition(logs, ranks, planFile);
  return {schemas::medianOf(steps), steps.size()};
}

/// What --calibrate's replay logs measured: the plan they replayed (the one their "plan" lines
/// name, which must be a plan of `trace`) and its step (calibrationStepUs). InputError naming the
/// log or plan that cannot serve.
planner::ReplayMeasurement measuredReplay(const std::vector<std::string>& logs, const schemas::Trace& trace,
                                          const std::string& traceFile) {
  planner::ReplayMeasurement m;
  std::string planFile;
  std::string names;
  std::vector<LoggedStep> steps;
  std::string graphLog, hostLog;  // the first log of graph replays (dcplan.graphed_step), and of steps
  // The first log with too few replays or steps to time, and why: refused after the kinds are checked,
  // so that a log of the other kind than its plan is told that first.
  std::string untimedLog, untimedWhy;
  for (const std::string& path : logs) {
    const schemas::ReplayLog log = schemas::readReplayLog(path);
    if (log.planFile.empty()) {
      throw schemas::InputError(path, {{"",
                                        "--calibrate: the log names no plan (its run replayed none): "
                                        "calibrate on the replay logs of a run with DCPLAN_PLAN"}});
    }
    if (!planFile.empty() && log.planFile != planFile) {
      throw schemas::InputError(path, {{"", "--calibrate: the log replayed " + log.planFile + ", " + logs[0] +
                                                " replayed " + planFile + ": give the logs of one run"}});
    }
    planFile = log.planFile;
    // A graphed step's: its replays' device times, as dcplan check takes them; else the host's steps.
    const bool graphed = log.graph.replays > 0;
    const std::optional<double> stepUs = graphed ? log.graph.stepUs : log.steps.medianUs;
    if (!stepUs && untimedLog.empty()) {
      untimedLog = path;
      untimedWhy = graphed ? "--calibrate: the log times " + std::to_string(log.graph.replays) +
                                 " graph replays; the first is left out (it uploads the graph), and the step is "
                                 "the median of at least " + std::to_string(schemas::kGraphTimedReplays) +
                                 " after it: run at least " + std::to_string(schemas::kGraphTimedReplays + 1) +
                                 " replays"
                           : "--calibrate: the log times " + std::to_string(log.steps.count) +
                                 " steps after the first; run at least 3 steps";
    }
    std::string& firstOfKind = graphed ? graphLog : hostLog;
    if (firstOfKind.empty()) firstOfKind = path;
    steps.push_back({path, log.rank, log.worldSize, stepUs.value_or(0.0)});
    names += (names.empty() ? "" : ", ") + std::filesystem::path(path).filename().string();
  }
  const schemas::Plan replayed = replayedPlan(logs.back(), planFile);
  const std::string digest = schemas::traceDigest(trace);
  if (replayed.source.traceDigest != digest) {
    throw schemas::InputError(planFile,
                              {{"/source/trace_digest",
                                "--calibrate: the replayed plan was made from "
                                "another trace (" +
                                    replayed.source.traceDigest + "), " + traceFile + " is " + digest}});
  }
  // Every log times the kind of step its plan runs: a graph's replays, or steps the host issued.
  if (!graphLog.empty() && !replayed.options.cudaGraph) {
    throw schemas::InputError(graphLog, {{"", "--calibrate: the log times replays of a CUDA graph (graph_replay "
                                              "lines), but the plan it names, " +
                                                  planFile +
                                                  ", is not for one (options.cuda_graph): give the logs of "
                                                  "one run of that plan"}});
  }
  if (!hostLog.empty() && replayed.options.cudaGraph) {
    throw schemas::InputError(hostLog, {{"", "--calibrate: the plan it names, " + planFile +
                                                 ", is for one CUDA graph (options.cuda_graph), but the log "
                                                 "times no graph replay (graph_replay lines): give the logs "
                                                 "of a run through dcplan.graphed_step"}});
  }
  if (!untimedLog.empty()) throw schemas::InputError(untimedLog, {{"", untimedWhy}});
  m.schedule = planner::scheduleOf(replayed);
  m.worldSize = replayed.source.worldSize;
  const CalibrationStep fitted = calibrationStep(steps, m.worldSize, planFile);
  m.stepUs = fitted.us;
  m.cudaGraph = replayed.options.cudaGraph;
  m.network = replayed.options.network;
  const std::string planName = std::filesystem::path(planFile).filename().string();
  m.description = names + (fitted.runs > 1 ? " (" + std::to_string(fitted.runs) + " replays of " + planName +
                                                  ", their median)"
                                    : " (a replay of " + planName + ")");
  return m;
}

void runPlan(const PlanCliOptions& o) {
  planner::PlanRequest req;
  req.strategy = *planner::parseStrategy(o.strategy);  // CLI11 checked the name
  try {
    if (!o.memoryBudget.empty()) req.memoryBudgetBytes = planner::parseByteSize(o.memoryBudget);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("--memory-budget: ") + e.what());
  }
  try {
    if (!o.bandwidth.empty()) req.bandwidthGBps = planner::parseBandwidthGBps(o.bandwidth);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("--bandwidth: ") + e.what());
  }
  req.worldSize = o.worldSize;
  req.traceName = std::filesystem::path(o.trace).filename().string();
  req.explain = o.explain;
  if (o.cudaGraph || o.noCudaGraph) req.cudaGraph = o.cudaGraph;  // else as the trace says

  schemas::Trace trace = schemas::readTrace(o.trace);
  if (!o.network.empty()) req.network = schemas::PlanNetwork{o.network, schemas::readNetwork(o.network)};
  if (!o.calibrate.empty()) {
    req.calibrate = measuredReplay(o.calibrate, trace, o.trace);
    // A replay of a plan made for a network is calibrated on that network unless told another.
    if (!req.network) req.network = req.calibrate->network;
  }
  // Progress only when planning is slow enough for someone to wonder.
  auto start = std::chrono::steady_clock::now();
  planner::ProgressFn progress = [start](const std::string& what) {
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s > 1.0) std::cerr << "dcplan: plan: " << what << " (" << static_cast<int>(s) << " s)\n";
  };
  planner::PlanResult result;
  try {
    result = planner::makePlan(trace, req, progress);
  } catch (const std::invalid_argument& e) {
    throw schemas::InputError(o.trace, {{"", e.what()}});
  }
  for (const std::string& w : result.warnings) std::cerr << "dcplan: warning: " << w << "\n";
  if (req.calibrate) std::cout << result.inSitu << "\n";
  schemas::writeFileAtomically(o.output, schemas::writePlan(result.plan));
  const std::string bound = planner::copyBoundLine(result.plan.predicted);
  if (!bound.empty()) std::cout << "dcplan plan: " << bound << "\n";
  for (const std::string& line : result.explanation) std::cout << line << "\n";
}

}  // namespace

void setupPlan(CLI::App& app) {
  auto o = std::make_shared<PlanCliOptions>();
  auto* cmd =
      app.add_subcommand("plan", "Plan a trace's communication: prefetch, persistence, reduce buckets");
  cmd->add_option("trace", o->trace, "trace file (dcplan.trace/v1)")->required();
  cmd->add_option("-o,--output", o->output, "plan file to write (dcplan.plan/v1)")->required();
  cmd->add_option(
      "--memory-budget", o->memoryBudget,
      "device memory the schedule may use, e.g. 40GiB, 80GB, 1.5e9 (default: the traced capacity)");
  cmd->add_option("--strategy", o->strategy, "default, heuristic or optimized")
      ->check(CLI::IsMember({"default", "heuristic", "optimized"}))
      ->capture_default_str();
  cmd->add_option("--world-size", o->worldSize,
                  "plan for this many ranks (default: as traced, or as --network measured)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--bandwidth", o->bandwidth, "plan for this bus bandwidth, GB/s (default: as calibrated)");
  cmd->add_flag("--explain", o->explain, "print why each decision was taken");
  cmd->add_flag(
      "--cuda-graph", o->cudaGraph,
      "plan and predict for a step replayed as one CUDA graph (dcplan.graphed_step): the device's own "
      "times, recorded on a GPU, without the host's (the default for a trace whose step ran in "
      "dcplan.graphed_step, meta.graphed)");
  cmd->add_flag("--no-cuda-graph", o->noCudaGraph,
                "plan for the host's replay (hooks or compiled graphs) even where the trace's step ran in "
                "dcplan.graphed_step")
      ->excludes("--cuda-graph");
  cmd->add_option(
         "--calibrate", o->calibrate,
         "the replay logs (DCPLAN_REPLAY_LOG) of a run of an earlier plan of this trace (or of several "
         "runs, each rank's log of each, three or more: their median run): plan again with the "
         "collectives' time, or the host's pace, fitted to the step they measured "
         "(docs/planning.md, \"Calibrated on a replay\")")
      ->expected(1, -1);
  cmd->add_option(
      "--network", o->network,
      "the collectives measured where the job will run (dcplan.network/v1, written by torchrun ... "
      "-m dcplan.measure_network): planned with them instead of the trace's calibration, for their "
      "world size unless --world-size says otherwise (docs/planning.md, cost model, \"What-if\")");
  cmd->callback([o] { runPlan(*o); });
}

}  // namespace dcplan::cli
