// GoogleTest of the plan cursor alone: positions, prefetch groups, persistence, flushes, departures, the log.
#include "PlanCursor.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

using namespace dcplan::replayer;

namespace {

// Graph 0 (forward): prefetch [1, 2] before position 0, [3] before position 3.
// Graph 1 (backward): buckets [3, 2] and [1]; 2 is persistent.
std::vector<CursorGraph> twoGraphs() {
  CursorGraph fwd;
  fwd.id = 0;
  fwd.groups[0] = {CursorGroup{{1, 2}}};
  fwd.groups[3] = {CursorGroup{{3}}};
  CursorGraph bwd;
  bwd.id = 1;
  bwd.backward = true;
  bwd.buckets = {{3, 2}, {1}};
  bwd.persistentEnds = {{1, 2}};  // 2's copy ends at its second release (position 1) before a step
  return {fwd, bwd};
}

OpEvent op(const char* name, int64_t graph, int64_t id = -1) { return OpEvent{name, graph, id, 0, {}}; }

/// The forward the plan was made for: gathers and releases of 1, 2, 3.
void forward(PlanCursor& c, std::vector<std::vector<int64_t>>* launched = nullptr) {
  c.onStartForward();
  const std::vector<OpEvent> ops = {op("allgather_param", 0, 1), op("allgather_param", 0, 2),
                                    op("release_param", 0, 1),   op("release_param", 0, 2),
                                    op("allgather_param", 0, 3), op("release_param", 0, 3)};
  for (const OpEvent& e : ops) {
    for (const auto& p : c.beforeOp(e)) {
      if (launched) launched->push_back(p.dsIds);
    }
  }
  c.onGraphEnd(-1);
}

}  // namespace

TEST(PlanCursor, LaunchesGroupsAtTheirPositions) {
  PlanCursor c("p.json", twoGraphs(), {2}, OnMismatch::Error, c10::ScalarType::BFloat16);
  c.onStartForward();
  auto at0 = c.beforeOp(op("allgather_param", 0, 1));  // position 0
  ASSERT_EQ(at0.size(), 1u);
  EXPECT_EQ(at0[0].dsIds, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(at0[0].dtype, c10::ScalarType::BFloat16);
  EXPECT_TRUE(c.beforeOp(op("allgather_param", 0, 2)).empty());  // position 1
  EXPECT_TRUE(c.beforeOp(op("release_param", 0, 1)).empty());
  EXPECT_EQ(c.beforeOp(op("release_param", 0, 2)).size(), 1u);  // position 3: [3]
  // Positions restart with every execution.
  c.onStartForward();
  EXPECT_EQ(c.beforeOp(op("allgather_param", 0, 1)).size(), 1u);
}

TEST(PlanCursor, KeepsPersistentAndFlushesAfterTheLastGradient) {
  PlanCursor c("p.json", twoGraphs(), {2}, OnMismatch::Error, c10::ScalarType::Undefined);
  forward(c);
  EXPECT_TRUE(c.keepGathered(2, false, false, true));
  EXPECT_FALSE(c.keepGathered(1, false, false, true));
  EXPECT_TRUE(c.keepGathered(1, false, true, true));  // ZeRO-1/2 keep everything anyway
  c.onStartBackward(true, true);
  EXPECT_FALSE(c.flushBefore(1, 1 << 30, 1 << 30, 16));  // the plan's boundaries, never the size
  c.beforeOp(op("reduce_grad", 1, 3));
  EXPECT_FALSE(c.flushAfter(1, 3));
  c.beforeOp(op("reduce_grad", 1, 2));
  EXPECT_TRUE(c.flushAfter(1, 2));  // bucket [3, 2] complete
  c.beforeOp(op("reduce_grad", 1, 1));
  EXPECT_TRUE(c.flushAfter(1, 1));
  c.beforeOp(op("end_backward", 1));
  c.onGraphEnd(1);
  EXPECT_TRUE(c.active());
}

TEST(PlanCursor, APersistentCopyEndsAtItsBackwardReleaseBeforeAnOptimizerStep) {
  PlanCursor c("p.json", twoGraphs(), {2}, OnMismatch::Error, c10::ScalarType::Undefined);
  forward(c);
  EXPECT_TRUE(c.keepGathered(2, false, false, true));  // kept through the forward
  // A micro-step before the accumulation boundary keeps it for the next forward.
  c.onStartBackward(false, false);
  c.beforeOp(op("release_param", 1, 2));
  EXPECT_TRUE(c.keepGathered(2, false, false, true));
  c.beforeOp(op("release_param", 1, 2));
  EXPECT_TRUE(c.keepGathered(2, false, false, true));
  c.onGraphEnd(1);
  // Before the optimizer step (sync), the step makes it stale: it ends at the release the plan
  // names (its last in the graph, where the planner's model ends it), not at an earlier one;
  // a frozen one, one the stage keeps, or one registered persistent stays.
  forward(c);
  c.onStartBackward(true, true);
  c.beforeOp(op("release_param", 1, 2));
  EXPECT_TRUE(c.keepGathered(2, false, false, true));
  c.beforeOp(op("release_param", 1, 2));
  EXPECT_FALSE(c.keepGathered(2, false, false, true));
  EXPECT_TRUE(c.keepGathered(2, false, false, false));
  EXPECT_TRUE(c.keepGathered(2, false, true, true));
  EXPECT_TRUE(c.keepGathered(2, true, false, true));
  c.onGraphEnd(1);
  // The next step's forward keeps its new copy again.
  forward(c);
  EXPECT_TRUE(c.keepGathered(2, false, false, true));
  EXPECT_TRUE(c.active());
}

TEST(PlanCursor, GradientOutOfOrderIsADeparture) {
  PlanCursor c("p.json", twoGraphs(), {}, OnMismatch::Error, c10::ScalarType::Undefined,
               {{1, "emb.weight"}, {2, "layers.0.w"}});
  forward(c);
  c.onStartBackward(true, true);
  c.beforeOp(op("reduce_grad", 1, 3));
  try {
    c.beforeOp(op("reduce_grad", 1, 1));
    FAIL() << "no departure";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("p.json: the run departs from the plan in graph 1 (backward) at position 1: expected "
                        "reduce_grad of layers.0.w (ds_id 2, bucket 0 of the plan), got reduce_grad of emb.weight "
                        "(ds_id 1)"),
              std::string::npos)
        << e.what_without_backtrace();
  }
  EXPECT_FALSE(c.active());
  // The default schedule from here on: flush by size, nothing kept beyond the stage.
  EXPECT_TRUE(c.flushBefore(1, 10, 10, 16));
  EXPECT_FALSE(c.keepGathered(2, false, false, true));
}

TEST(PlanCursor, LaterExecutionsMustMatchTheFirst) {
  PlanCursor c("p.json", twoGraphs(), {}, OnMismatch::Fallback, c10::ScalarType::Undefined);
  forward(c);
  c.onStartForward();
  c.beforeOp(op("allgather_param", 0, 1));
  c.beforeOp(op("allgather_param", 0, 2));
  EXPECT_TRUE(c.beforeOp(op("allgather_param", 0, 3)).empty());  // the first forward released 1 here
  EXPECT_FALSE(c.active());
  const std::string msg = c.takeDeparture();
  EXPECT_NE(msg.find("in graph 0 (forward) at position 2: expected release_param of ds_id 1, got "
                     "allgather_param of ds_id 3; continuing without the plan"),
            std::string::npos)
      << msg;
  EXPECT_EQ(c.takeDeparture(), "");  // warned once
  // No more prefetches once departed.
  c.onStartForward();
  c.beforeOp(op("allgather_param", 0, 1));
  EXPECT_TRUE(c.beforeOp(op("allgather_param", 0, 2)).empty());
}

TEST(PlanCursor, PrefetchedButNeverGatheredIsADeparture) {
  PlanCursor c("p.json", twoGraphs(), {}, OnMismatch::Error, c10::ScalarType::Undefined);
  c.onStartForward();
  c.beforeOp(op("allgather_param", 0, 1));  // [1, 2] prefetched here; 2 never comes
  c.beforeOp(op("release_param", 0, 1));
  c.beforeOp(op("allgather_param", 0, 3));
  c.beforeOp(op("release_param", 0, 3));  // position 3: [3] prefetched, never gathered again
  try {
    c.onGraphEnd(-1);
    FAIL() << "no departure";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("in graph 0 (forward) at position 4: expected allgather_param of ds_id "),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

TEST(PlanCursor, WritesTheReplayLog) {
  const std::string path = ::testing::TempDir() + "plan_cursor_log.jsonl";
  {
    PlanCursor c("p.json", twoGraphs(), {2}, OnMismatch::Error, c10::ScalarType::Undefined);
    c.openLog(path);
    std::vector<std::vector<int64_t>> launched;
    forward(c, &launched);
    EXPECT_EQ(launched, (std::vector<std::vector<int64_t>>{{1, 2}, {3}}));
  }
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string log = text.str();
  EXPECT_EQ(
      log.rfind("{\"ev\":\"plan\",\"file\":\"p.json\",\"persistent\":[2]}\n{\"ev\":\"start_forward\"}\n", 0),
      0u)
      << log;
  // Each op line ends with the host's time at the op (t_us, CLOCK_MONOTONIC microseconds).
  const std::string op =
      "{\"ev\":\"op\",\"graph\":0,\"pos\":4,\"op\":\"allgather_param\",\"ds_id\":3,\"t_us\":";
  const size_t at = log.find(op);
  ASSERT_NE(at, std::string::npos) << log;
  const int64_t opUs = std::stoll(log.substr(at + op.size()));
  const int64_t nowUs = std::chrono::duration_cast<std::chrono::microseconds>(
                            std::chrono::steady_clock::now().time_since_epoch())
                            .count();
  EXPECT_GT(opUs, 0);
  EXPECT_LE(opUs, nowUs);
  EXPECT_NE(log.find("{\"ev\":\"end\",\"graph\":-1}"), std::string::npos);
  std::remove(path.c_str());
}

namespace {

/// The op lines' t_us of a log file.
std::vector<int64_t> opTimes(const std::string& path) {
  std::ifstream in(path);
  std::vector<int64_t> times;
  for (std::string line; std::getline(in, line);) {
    const size_t at = line.find("\"t_us\":");
    if (line.rfind("{\"ev\":\"op\"", 0) == 0 && at != std::string::npos) {
      times.push_back(std::stoll(line.substr(at + 7)));
    }
  }
  return times;
}

/// Runs the forward with a log whose gauge takes 2 ms a read; returns the op lines' times, the
/// log's cost over the forward (us) and when each gauge read began (us, steady clock).
struct LoggedForward {
  std::vector<int64_t> times;
  int64_t costUs = 0;
  std::vector<int64_t> gaugeUs;
};
LoggedForward loggedForward(bool leaveOutOwnTime) {
  const std::string path = ::testing::TempDir() + "plan_cursor_log_cost.jsonl";
  LoggedForward out;
  {
    PlanCursor c("p.json", twoGraphs(), {2}, OnMismatch::Error, c10::ScalarType::Undefined);
    auto* reads = &out.gaugeUs;
    c.openLog(
        path,
        [reads] {
          const auto now = std::chrono::steady_clock::now();
          reads->push_back(
              std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count());
          while (std::chrono::steady_clock::now() < now + std::chrono::milliseconds(2)) {
          }
          return OpMemory{};
        },
        leaveOutOwnTime);
    const int64_t before = c.logCostUs();
    forward(c);
    out.costUs = c.logCostUs() - before;
  }
  out.times = opTimes(path);
  std::remove(path.c_str());
  return out;
}

}  // namespace

TEST(PlanCursor, OnCpuRanksTheLogsTimesLeaveOutTheLogsOwnWork) {
  // Between the first op's gauge read and the last's, five 2 ms reads ran: the op lines' times
  // leave them out (each line's own microsecond rounding aside), whatever else took the thread.
  const LoggedForward cpu = loggedForward(true);
  ASSERT_EQ(cpu.times.size(), 6u);
  ASSERT_EQ(cpu.gaugeUs.size(), 6u);
  EXPECT_GE(cpu.costUs, 12'000);  // six reads
  const int64_t between = cpu.gaugeUs.back() - cpu.gaugeUs.front();
  EXPECT_LE(cpu.times.back() - cpu.times.front(), between - 5 * 2000 + 6);
  // On a GPU the clock is kept: the log's host work may overlap the device's.
  const LoggedForward gpu = loggedForward(false);
  ASSERT_EQ(gpu.times.size(), 6u);
  EXPECT_GE(gpu.times.back() - gpu.times.front(), 5 * 2000);
}
