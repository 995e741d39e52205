// What a replay log (JSON lines, docs/replay.md) measured of a run's steps. One rule for the
// planner (dcplan plan --calibrate) and the check (dcplan check, through dcplan._C).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dcplan::schemas {

/// The fields of a log line the step times come from.
struct ReplayLogEvent {
  std::string ev;    ///< "mark", "start_backward", "op", ...
  int64_t tUs = 0;   ///< "mark": the host's monotonic clock, microseconds
  bool sync = true;  ///< "start_backward": false on a micro-step before an accumulation boundary
  bool grad = true;  ///< "mark": false for a forward without grad (an eval forward)
  double deviceUs = 0;  ///< "graph_replay": the replay's device time (CUDA events around it)
};

/// The host time of each optimizer step's start: its first training forward's mark (a backward
/// with sync false leaves the step open, so the next forward's mark does not start one; an eval
/// forward's mark, without grad, starts none).
std::vector<int64_t> stepStarts(const std::vector<ReplayLogEvent>& events);

/// The median time between step starts, the first step left out as warm-up; nullopt with fewer
/// than 3 starts (no interval after the first).
struct MeasuredSteps {
  std::optional<double> medianUs;
  int64_t count = 0;  ///< intervals the median is taken over
};
MeasuredSteps measuredSteps(const std::vector<int64_t>& starts);

/// The median as dcplan check and --calibrate take it: with an even count, the mean of the middle
/// two. `values` is reordered; it must not be empty.
double medianOf(std::vector<double>& values);

/// How many replays of a step captured in one CUDA graph its time is the median of, after the first
/// (which uploads the graph to the device): the recorder's calibration.graph_step_us, dcplan check's
/// graphed step and --calibrate's alike (graphStepUs).
inline constexpr int64_t kGraphTimedReplays = 3;

/// A captured step's time from its replays' device times, in order: the median of those after the
/// first; nullopt with fewer than kGraphTimedReplays of them.
std::optional<double> graphStepUs(std::vector<double> replayUs);

/// The step a log of dcplan.graphed_step measured: its last capture's replays (a step captured again
/// runs that graph from then on), timed by graphStepUs.
struct MeasuredGraphReplays {
  int64_t replays = 0;           ///< graph_replay lines after the last graph_capture
  std::optional<double> stepUs;  ///< graphStepUs of their device times
  /// The replays the step is the median of (all but the first).
  int64_t timed() const { return replays > 0 ? replays - 1 : 0; }
};
MeasuredGraphReplays measuredGraphReplays(const std::vector<ReplayLogEvent>& events);

/// A replay log read for its steps: the plan file its "plan" line names (the last one with a
/// file; "" if none) and the measured steps.
struct ReplayLog {
  std::string path;
  std::string planFile;
  /// The rank that wrote it and its world size (the plan line's "rank" and "world_size"); -1 and
  /// 0 in a log that does not say (written before they were logged, or with no runtime started).
  int rank = -1;
  int worldSize = 0;
  MeasuredSteps steps;
  /// Replays of a step captured in one CUDA graph (dcplan.graphed_step), which the host issues no
  /// op of and the step rule cannot time; none in a log of the host's steps.
  MeasuredGraphReplays graph;
};

/// Reads a replay log; throws InputError naming the file and the line that is not JSON.
ReplayLog readReplayLog(const std::string& path);

}  // namespace dcplan::schemas
