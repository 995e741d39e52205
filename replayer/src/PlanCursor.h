// The plan cursor: a SchedulePolicy that follows a plan's prefetches, persistence and buckets op by op.
#pragma once

#include "dcplan/replayer/Plan.h"
#include "dcplan/replayer/Schedule.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace dcplan::replayer {

/// Follows a plan: at each op a hook issues it counts the op's position in its
/// graph (reset at start_forward / start_backward), launches the prefetch
/// groups planned there, keeps the persistent parameters gathered, and flushes
/// a bucket when the last gradient it lists arrives. It checks every op against
/// what the plan implies and against the first execution of the same graph;
/// at a departure it raises (OnMismatch::Error) or warns once and continues
/// with the default schedule (OnMismatch::Fallback). Without a plan it is the
/// default schedule. Either way it can write the replay log.
class PlanCursor final : public SchedulePolicy {
 public:
  /// No plan: the default schedule, with positions counted for the replay log.
  PlanCursor() = default;
  /// names: each parameter's qualified name by ds_id, for the departure messages.
  PlanCursor(std::string file, std::vector<CursorGraph> graphs, std::vector<int64_t> persistent,
             OnMismatch onMismatch, c10::ScalarType gatherDtype,
             std::unordered_map<int64_t, std::string> names = {});
  ~PlanCursor() override;
  PlanCursor(const PlanCursor&) = delete;
  PlanCursor& operator=(const PlanCursor&) = delete;

  std::vector<Prefetch> beforeOp(const OpEvent& event) override;
  void onGatherLaunched(int64_t graphId, const std::vector<int64_t>& dsIds, int64_t bytes,
                        bool planned) override;
  void onGuardHold(int64_t graphId, const GuardHold& hold) override;
  bool keepGathered(int64_t dsId, bool registeredPersistent, bool stageKeepsAll, bool trainable) override;
  int64_t keptPeak(int64_t dsId) override;
  /// The plan's guard.persistent_peak_bytes, one per id of `persistent` (the budget guard's).
  void setKeptPeaks(const std::vector<int64_t>& persistent, const std::vector<uint64_t>& peaks);
  bool flushBefore(int64_t graphId, int64_t pendingBytes, int64_t nextBytes, int64_t bucketBytes) override;
  bool flushAfter(int64_t graphId, int64_t dsId) override;
  const std::vector<int64_t>* plannedBucket(int64_t graphId, int64_t dsId) override;
  void onFlush(int64_t graphId, const std::vector<int64_t>& dsIds, int64_t bytes) override;
  void onGraphEnd(int64_t graphId) override;
  void onStartForward() override;
  void onStartBackward(bool update, bool sync) override;

  bool hasPlan() const { return !file_.empty(); }
  /// The plan drives the schedule (loaded, and no departure so far).
  bool active() const { return hasPlan() && !departed_; }
  const std::string& file() const { return file_; }
  /// The fallback departure's message, once; "" when none or already taken.
  std::string takeDeparture();

  /// Replay log: JSON lines written to path (truncated); "" stops logging. The gauge, if any,
  /// is read at each op. leaveOutOwnTime: the op lines' t_us are the host's clock less
  /// logCostUs(), for where the host is the device (CPU ranks), whose steps the log's host work
  /// lengthens by all of it; on a GPU it may overlap the device's work, and the clock is kept.
  void openLog(const std::string& path, MemoryGauge gauge = {}, bool leaveOutOwnTime = false, LogRank who = {});
  void flushLog();
  /// The host time this log's writing took since it opened (its lines' dump and write, each op
  /// line's gauge read, its flushes), in microseconds.
  int64_t logCostUs() const { return logNs_ / 1000; }
  /// The log's clock at host time nowNs (monotonicNs), in microseconds: what every line's t_us
  /// reads, less logCostUs() where openLog was told to leave the log's own time out.
  int64_t logClockUs(int64_t nowNs) const { return (nowNs - (leaveOutOwnTime_ ? logNs_ : 0)) / 1000; }
  bool leavesOutOwnTime() const { return leaveOutOwnTime_; }
  /// Moves the log (open file and path) from another cursor.
  void takeLogFrom(PlanCursor& other);
  /// Writes the log's plan line (file, persistent set, and the rank writing it where known).
  void logPlan();
  /// Writes one raw JSON object line (already formatted) to the log.
  void logLine(const std::string& json);
  /// Writes one JSON object as a line of the log; its cost counts from sinceNs (the host clock,
  /// where the caller began the line's work) or, 0, from the call.
  void logJson(const nlohmann::ordered_json& line, int64_t sinceNs = 0);

 private:
  /// One op as the cursor checks it. The runtime's op names are string literals: kept as such (no
  /// string is built per op), with the op's role from the trace format's table (roleOf).
  struct Op {
    const char* name = "";
    std::optional<schemas::OpRole> role;
    int64_t dsId = -1;  ///< -1: none
    bool operator==(const Op& o) const {
      return dsId == o.dsId && role == o.role && (name == o.name || std::strcmp(name, o.name) == 0);
    }
  };
  /// The role of a runtime op name, looked up once per name (by its address: a string literal).
  std::optional<schemas::OpRole> roleOf(const char* name);
  /// What a departure expected, and what happened instead.
  struct Departure {
    std::string expected;
    std::string actual;
  };

  /// Per-execution state of a planned graph.
  struct Run {
    bool running = false;
    std::vector<Op> ops;                     // this execution so far
    std::optional<std::vector<Op>> learned;  // the first complete execution
    std::unordered_map<int64_t, std::vector<int64_t>>
        prefetched;    // id -> positions launched, not gathered yet
    size_t ready = 0;  // next index into readyOrder
    std::unordered_set<int64_t> reduced;
    std::unordered_set<int64_t> bucketed;  // gradients put in a bucket so far
    std::vector<int64_t> arrived;          // per bucket: gradients in it so far
  };
  struct Planned {
    CursorGraph plan;
    std::vector<int64_t> readyOrder;  // bucket ids concatenated
    std::unordered_map<int64_t, size_t> bucketOf;
    int64_t lastPosition = -1;
    Run run;
  };

  Planned* planned(int64_t graphId);
  void resetPositions();
  void startRun(Planned& g);
  /// Checks op at position pos of g; returns the departure (expected, actual) if any.
  std::optional<Departure> check(Planned& g, int64_t pos, const Op& op);
  /// "reduce_grad of layers.0.w (ds_id 7, <note>)": an op as a departure message names it
  /// (without a name for the id: "reduce_grad of ds_id 7 (<note>)").
  std::string describe(const char* op, int64_t dsId, const std::string& note = "") const;
  /// The gradient the plan expects next in g, with its bucket.
  std::string expectedGradient(const Planned& g) const;
  void endRun(Planned& g, int64_t pos);
  /// Reports a departure: raises or switches to the default schedule.
  void depart(int64_t graphId, int64_t pos, const Departure& d);

  std::string file_;
  std::unordered_map<int64_t, std::string> names_;
  std::unordered_map<const char*, std::optional<schemas::OpRole>> roles_;
  std::map<int64_t, Planned> graphs_;
  std::unordered_set<int64_t> persistent_;
  std::unordered_map<int64_t, int64_t> keptPeaks_;  // persistent ds_id -> its peak (budget guard)
  std::vector<int64_t> persistentSorted_;
  OnMismatch onMismatch_ = OnMismatch::Error;
  c10::ScalarType gatherDtype_ = c10::ScalarType::Undefined;
  bool departed_ = false;
  bool stepFollows_ = false;  // the backward running is the last micro-step's (onStartBackward's sync)
  std::string departure_;
  bool departureTaken_ = false;

  std::unordered_map<int64_t, int64_t> positions_;  // graph -> next position
  int64_t curGraph_ = -1;                           // the op being run
  int64_t curPos_ = -1;
  std::vector<std::vector<int64_t>> launching_;            // groups beforeOp returned, until reported
  std::map<std::pair<int64_t, int64_t>, int64_t> heldAt_;  // (graph, ds_id) held back -> position

  std::string logPath_;
  std::unique_ptr<std::ofstream> log_;
  MemoryGauge gauge_;
  int64_t logNs_ = 0;             // logCostUs(), in nanoseconds
  bool leaveOutOwnTime_ = false;  // openLog's
  LogRank logRank_;               // openLog's
};

}  // namespace dcplan::replayer
