// dcplan's planner: the three decisions (prefetch, persistence, buckets) under a memory budget.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dcplan/planner/simulator.h"
#include "dcplan/schemas/plan.h"
#include "dcplan/schemas/trace.h"

namespace dcplan::planner {

enum class Strategy { Default, Heuristic, Optimized };

const char* strategyName(Strategy s);
/// "default", "heuristic" or "optimized"; nullopt otherwise.
std::optional<Strategy> parseStrategy(std::string_view name);

/// The reference's prefetch grouping factor: gathers are launched this many at a
/// time, one group ahead of use.
inline constexpr int kReferencePrefetchFactor = 3;
/// Shares of the memory headroom (budget minus the default schedule's peak) the
/// reference's rules may use for prefetch in flight and for persistent parameters.
inline constexpr double kReferencePrefetchShare = 0.5;
inline constexpr double kReferencePersistShare = 0.5;

/// Share of a memory limit (--memory-budget, or the device's capacity) kept for what the memory
/// model does not see: the loss and optimizer scalars, library workspaces, and the CUDA caching
/// allocator handing out a cached block whole when what would be left is 1 MiB or less (its
/// allocated bytes count the whole block). Measured against the runtime's allocation log: 408
/// bytes over the prediction at 8 MiB on 2 CPU ranks (0.005%), 1 MiB at 18 GiB on one H200
/// (0.005%), 49 MiB at 25 GiB where a plan gathered 147 parameters at once (0.2%).
inline constexpr double kUnseenReserveShare = 0.005;

/// What schedules are planned against for a memory limit: the limit less kUnseenReserveShare.
inline uint64_t plannedLimit(uint64_t limit) {
  return limit - static_cast<uint64_t>(static_cast<double>(limit) * kUnseenReserveShare);
}

/// A replay of an earlier plan of the same trace, measured (dcplan plan --calibrate).
struct ReplayMeasurement {
  Schedule schedule;        ///< the replayed plan's decisions (scheduleOf)
  int64_t worldSize = 0;    ///< the replayed plan's
  bool cudaGraph = false;   ///< a CUDA graph's replay has no replay log: refused
  double stepUs = 0;        ///< the measured step (the slowest rank's median)
  std::string description;  ///< what was measured, for messages ("replay.0.jsonl, replay.1.jsonl of p.json")
  /// The network the replayed plan was made with (--network); the new plan must be made with it.
  std::optional<schemas::PlanNetwork> network;
};

struct PlanRequest {
  Strategy strategy = Strategy::Optimized;
  std::optional<uint64_t> memoryBudgetBytes;  ///< absent: the device capacity, if known
  int64_t worldSize = 0;                      ///< 0: the trace's
  std::optional<double> bandwidthGBps;        ///< what-if bus bandwidth
  std::string traceName;                      ///< recorded in plan.source.trace
  bool explain = false;                       ///< fill PlanResult::explanation
  /// For dcplan.graphed_step (StepReplay::CudaGraph); absent: as the trace says (meta.graphed).
  std::optional<bool> cudaGraph;
  /// Plan with the collectives' in-situ scale fitted to this replay (InSituFit::Source::Replay).
  std::optional<ReplayMeasurement> calibrate;
  /// Plan with these collectives instead of the trace's calibration (--network), for its world
  /// size unless worldSize says otherwise; the plan carries them (options.network).
  std::optional<schemas::PlanNetwork> network;
};

struct PlanResult {
  schemas::Plan plan;
  std::vector<std::string> explanation;  ///< why each decision was taken (with explain)
  std::vector<std::string> warnings;     ///< e.g. a default schedule over the budget
  std::string inSitu;                    ///< the in-situ line (in_situ.h), where a scale was fitted
};

/// Called between planning phases with a short description of what is next.
using ProgressFn = std::function<void(const std::string&)>;

/// Plans `trace`. Deterministic: the same trace and request give the same plan.
/// Throws std::invalid_argument when the trace cannot be planned or the budget
/// cannot be met by any schedule (the message says what would fit).
PlanResult makePlan(const schemas::Trace& trace, const PlanRequest& request, const ProgressFn& progress = {});

/// The cost model's settings for planning `workload` at its planned world size: the launch cost
/// measured from the trace when it has host times (measuredLaunchUs), else the default; none for
/// a CUDA graph's replay.
CostModelOptions costOptions(const Workload& workload, std::optional<double> bandwidthGBps);

/// Gather on use, kDefaultBucketBytes buckets along gradient-ready order, no
/// persistence (every parameter persistent for stages 1 and 2).
Schedule defaultSchedule(const Workload& workload);

/// The decisions of a plan, for simulation.
Schedule scheduleOf(const schemas::Plan& plan);

/// Collectives the recorded run issued: those of the default schedule, which it ran. The
/// SimOptions::referenceCalls of every prediction the planner makes.
int64_t recordedCalls(const Workload& workload, const CostModel& cost);

}  // namespace dcplan::planner
