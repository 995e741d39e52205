// Replay of a plan (dcplan.plan/v1): loading and checking it against the live model, and the replay log.
#pragma once

#include "dcplan/schemas/plan.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace dcplan::replayer {

/// A plan that cannot drive this run: what() is one line,
/// "<file>: <JSON pointer>: <what differs>".
class PlanError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// One parameter of the live model, as the parameter signature sees it.
struct LiveParam {
  int64_t dsId = 0;
  std::string name;  ///< qualified name (model.named_parameters())
  std::vector<int64_t> shape;
  std::string dtype;  ///< dtype of the master shard, torch's name without "torch."
  bool trainable = true;
};

/// What a plan is checked against.
struct LiveModel {
  std::vector<LiveParam> params;
  int64_t worldSize = 1;
  int64_t stage = 3;
  int64_t forwardGraph = 0;
  int64_t backwardGraph = 1;
  std::string reduceDtype;  ///< dtype gradients are reduced in
  /// dtype of the planned prefetches (the gathers' dtype); nullopt: the shard's.
  std::optional<c10::ScalarType> gatherDtype;
  bool compiled = false;  ///< dcplan.shard(compile=True): the plan must come from a compiled trace
};

enum class OnMismatch { Error, Fallback };

/// What a loaded plan asks of the hooks.
struct PlanSummary {
  std::string signature;            ///< the live model's parameter signature
  std::vector<int64_t> persistent;  ///< ds_ids kept gathered between uses
  int64_t prefetchGroups = 0;
  int64_t buckets = 0;
  bool cudaGraph = false;  ///< made for one CUDA graph per step (options.cuda_graph)
  /// ds_ids whose optimizer state the plan keeps on the host, per group in stepping order.
  std::vector<std::vector<int64_t>> optimizerOffload;
  /// Each of those groups' optimizer state on the host, in bytes (the plan's offload bytes): the
  /// runtime allocates its host buffers before step 0.
  std::vector<uint64_t> optimizerOffloadBytes;
  /// ds_ids whose master shards the plan keeps on the host between uses (ZeRO-3).
  std::vector<int64_t> masterOffload;
  /// The host memory the plan's offload keeps on each rank (the plan's bytes at its world size):
  /// its groups' optimizer state and their master shards, checked against the host's before step 0.
  uint64_t offloadStateBytes = 0;
  uint64_t offloadMasterBytes = 0;
  std::optional<uint64_t> memoryBudgetBytes;  ///< the plan's options.memory_budget_bytes
  std::optional<int64_t> guardStartBytes;     ///< the plan's guard.start_bytes
  /// The input shapes of the live model's forward graph in the recorded step (input_shapes).
  std::optional<schemas::InputShapes> inputShapes;
  /// The saves of the live model's forward that go to the host (its graph's offload_saves), and
  /// that field's JSON pointer ("/graphs/0/offload_saves"; empty without any).
  std::vector<schemas::OffloadedSave> offloadSaves;
  std::string offloadSavesPointer;
};

/// One prefetch group of a plan: its ids and its peak (the plan's peak_bytes, -1: not given).
struct CursorGroup {
  std::vector<int64_t> dsIds;
  int64_t peakBytes = -1;
};

/// One graph of a plan as a replay follows it: the prefetch groups launched just before the op at
/// each position (in plan order), and the buckets in gradient-ready order, frozen parameters left
/// out and empty buckets dropped. The plan cursor follows these and the replay check
/// (dcplan.replay_differences, through dcplan._C.followed_graphs) compares a replay log with them.
struct CursorGraph {
  int64_t id = 0;
  bool backward = false;
  std::map<int64_t, std::vector<CursorGroup>> groups;  ///< position -> groups
  std::vector<std::vector<int64_t>> buckets;
  /// Backward: (position, ds_id) of each release where a persistent copy ends before an optimizer
  /// step (the plan's persistent_ends, frozen parameters left out).
  std::set<std::pair<int64_t, int64_t>> persistentEnds;
};

/// The graphs of `plan` as a replay follows them, `frozen` parameters' gradients left out
/// (freezing a parameter keeps the plan: its gradient never arrives).
std::vector<CursorGraph> followedGraphs(const schemas::Plan& plan, const std::set<int64_t>& frozen);

/// The parameter signature of docs/formats.md for the live model.
std::string liveSignature(const LiveModel& model);

/// Reads and validates plan file `path`, checks it against `model` and makes
/// it the runtime's schedule (keeping an open replay log). Throws PlanError.
PlanSummary loadPlan(const std::string& path, const LiveModel& model, OnMismatch onMismatch);

/// Memory read at each op of the replay log: the bytes in use when the op is issued and, where the
/// allocator can say without disturbing anyone, the most in use since the previous op (-1: unknown).
struct OpMemory {
  int64_t inUse = -1;
  int64_t peakBefore = -1;
};
using MemoryGauge = std::function<OpMemory()>;

/// The budget guard of a replay (docs/replay.md): a planned prefetch group whose peak_bytes, or a
/// persistent copy whose persistent_peak_bytes, plus what the run holds beyond the plan's model
/// (agreed by the ranks: setBudgetGuardExcess) would exceed budgetBytes is not launched, or not
/// kept: its parameters are gathered by their own ops. startBytes: the plan's guard.start_bytes.
/// nullopt: no guard. Each hold is a "hold" line in the replay log.
void setBudgetGuard(std::optional<int64_t> budgetBytes, int64_t startBytes = 0);
/// The most any rank holds beyond the plan's model, measured at a step's start against
/// startBytes and agreed by the ranks; until it is set, the guard holds nothing back.
void setBudgetGuardExcess(int64_t excessBytes);
/// A message about the budget guard's first hold, once; "" after or without.
std::string takeBudgetGuardNote();

/// Writes the replay log of this rank to `path` from now on (JSON lines, see
/// docs/replay.md); replaces the default schedule by an equivalent one that logs
/// when no plan is loaded. An empty path stops logging. With a gauge, each op line
/// carries its memory (the runtime's allocation log). leaveOutOwnTime (CPU ranks): the lines'
/// times leave out the log's own host time (PlanCursor::openLog). who: the rank writing it, named
/// in its plan line (dcplan plan --calibrate groups several runs' logs by it).
struct LogRank {
  int rank = -1;  ///< -1: not known (no runtime started)
  int worldSize = 0;
};
void setReplayLog(const std::string& path, MemoryGauge gauge = {}, bool leaveOutOwnTime = false, LogRank who = {});
/// Writes what the replay log has buffered.
void flushReplayLog();
/// The replay log's clock now, as its op lines read it (PlanCursor::logClockUs): the host's
/// monotonic microseconds, less the log's own host time since it opened (costUs) where it leaves
/// that out (CPU ranks); the plain clock and 0 without a log.
struct ReplayLogClock {
  int64_t tUs = 0;
  int64_t costUs = 0;
  bool ownTimeLeftOut = false;
};
ReplayLogClock replayLogClock();
/// Appends one JSON object (one line, no newline) to this rank's replay log, if one is open:
/// what the Python side measures (step marks: time and memory peak).
void logReplayEvent(const std::string& json);
/// After a departure with OnMismatch::Fallback: its message, returned once
/// (the caller warns); "" otherwise.
std::string takePlanDeparture();
/// Whether the loaded plan still drives the schedule (false: none, or a
/// departure switched to gather on use).
bool planActive();

}  // namespace dcplan::replayer
