// Tests of the step times read from a replay log (one rule for dcplan plan --calibrate and dcplan check).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "dcplan/schemas/io.h"
#include "dcplan/schemas/replay_log.h"

namespace dcplan::schemas {
namespace {

ReplayLogEvent mark(int64_t t) { return {"mark", t, true}; }
ReplayLogEvent backward(bool sync) { return {"start_backward", 0, sync}; }

TEST(ReplayLog, AStepStartsAtItsFirstForwardsMark) {
  // Two micro-steps per optimizer step: the backward of the first does not synchronise.
  const std::vector<int64_t> starts = stepStarts({mark(0),
                                                  backward(false),
                                                  mark(10),
                                                  backward(true),
                                                  mark(100),
                                                  backward(false),
                                                  mark(110),
                                                  backward(true),
                                                  mark(250),
                                                  {"op", 999, true}});
  EXPECT_EQ(starts, (std::vector<int64_t>{0, 100, 250}));
  // An eval forward (no grad) after a step's backward starts no step; the training forward does.
  const ReplayLogEvent eval{"mark", 150, true, false};
  EXPECT_EQ(stepStarts({mark(0), backward(true), eval, mark(170), backward(true), mark(300)}),
            (std::vector<int64_t>{0, 170, 300}));
}

TEST(ReplayLog, TheMedianLeavesTheFirstStepOut) {
  const MeasuredSteps m = measuredSteps({0, 1000, 1100, 1300, 1400});  // 1000 (warm-up), 100, 200, 100
  EXPECT_EQ(m.count, 3);
  EXPECT_DOUBLE_EQ(*m.medianUs, 100.0);
  EXPECT_DOUBLE_EQ(*measuredSteps({0, 1000, 1100, 1300}).medianUs, 150.0);  // even: the middle two's mean
  EXPECT_FALSE(measuredSteps({0, 1000}).medianUs);
  EXPECT_EQ(measuredSteps({0, 1000}).count, 0);
}

TEST(ReplayLog, ReadsTheReplayedPlanAndTheStepsAndNamesABadLine) {
  const std::filesystem::path path = std::filesystem::temp_directory_path() / "dcplan_replay_log_test.jsonl";
  {
    std::ofstream out(path);
    out << R"({"ev":"plan","file":null,"persistent":[]})"
        << "\n"
        << R"({"ev":"plan","file":"p.json","persistent":[1]})"
        << "\n\n";
    for (int i = 0; i < 4; ++i) {
      out << R"({"ev":"mark","t_us":)" << i * 50 << R"(,"peak_bytes":1})"
          << "\n"
          << R"({"ev":"start_backward","update":true,"sync":true})"
          << "\n";
    }
  }
  const ReplayLog log = readReplayLog(path.string());
  EXPECT_EQ(log.planFile, "p.json");
  EXPECT_EQ(log.steps.count, 2);
  EXPECT_DOUBLE_EQ(*log.steps.medianUs, 50.0);
  {
    std::ofstream out(path, std::ios::app);
    out << "[1, 2]\n";
  }
  try {
    readReplayLog(path.string());
    FAIL() << "read a line that is not an event";
  } catch (const InputError& e) {
    EXPECT_EQ(e.file(), path.string());
    EXPECT_NE(std::string(e.what()).find("line 12: expected a JSON object with \"ev\""), std::string::npos)
        << e.what();
  }
  std::filesystem::remove(path);
  EXPECT_THROW(readReplayLog(path.string()), InputError);
}

}  // namespace
}  // namespace dcplan::schemas
