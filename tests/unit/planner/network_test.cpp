// dcplan plan --network: a trace recorded on one rank planned for the ranks a network file measured.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <stdexcept>
#include <string>

#include "dcplan/planner/planner.h"
#include "dcplan/planner/report.h"
#include "tiny_trace.h"

namespace dcplan::planner {
namespace {

/// The tiny trace as recorded on one rank: whole shards, the transport's own copies calibrated.
schemas::Trace oneRankTrace() {
  schemas::Trace t = test::tinyTrace();
  t.meta.worldSize = 1;
  for (schemas::TraceParam& p : t.params) p.shardNumel = p.numel;
  return t;
}

/// Two ranks whose all-gather and reduce-scatter take `us` per 1,000 bytes beyond 10 us.
schemas::PlanNetwork twoRanks(double us) {
  schemas::PlanNetwork n;
  n.file = "net.json";
  n.measured.worldSize = 2;
  n.measured.backend = "nccl";
  n.measured.device = "test";
  for (uint64_t b : {10'240ull, 102'400ull, 1'024'000ull}) {
    const double t = 10 + us * static_cast<double>(b) / 1000;
    n.measured.calibration.allGather.push_back({b, t});
    n.measured.calibration.reduceScatter.push_back({b, t});
  }
  return n;
}

std::string refusal(const schemas::Trace& t, const PlanRequest& req) {
  try {
    makePlan(t, req);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "planned";
}

TEST(Network, AOneRankTraceIsPlannedForTheRanksItMeasured) {
  const schemas::Trace t = oneRankTrace();
  PlanRequest req;
  req.strategy = Strategy::Default;
  req.worldSize = 2;
  EXPECT_NE(refusal(t, req).find("and plan with --network net.json"), std::string::npos);

  req.worldSize = 0;  // the network's
  req.network = twoRanks(1.0);
  const PlanResult fast = makePlan(t, req);
  EXPECT_EQ(fast.plan.source.worldSize, 2);
  ASSERT_TRUE(fast.plan.options.network);
  EXPECT_EQ(fast.plan.options.network->file, "net.json");
  EXPECT_FALSE(fast.plan.options.inSituScale);
  // Half the shards' memory: the baseline scales by the traced world size over the planned one.
  const PlanResult oneRank = makePlan(t, PlanRequest{Strategy::Default});
  EXPECT_LT(fast.plan.predicted.peakMemoryBytes, oneRank.plan.predicted.peakMemoryBytes);

  // A network whose collectives take 10x as long: the default schedule exposes every gather and
  // the reduction, each 9 us per 1,000 bytes slower (4 gathers and 1 bucket of 102,400 bytes each
  // beyond the tiny trace's compute, which hides none of them).
  req.network = twoRanks(10.0);
  const PlanResult slow = makePlan(t, req);
  EXPECT_GT(slow.plan.predicted.stepUs, fast.plan.predicted.stepUs + 4 * 9 * 102.4);

  // What inspect simulates again is what the plan predicted: the plan carries the network.
  const auto curve = nlohmann::json::parse(renderMemoryCurve(slow.plan, "plan.json", t));
  EXPECT_NEAR(curve["step_us"].get<double>(), slow.plan.predicted.stepUs, 0.01);
  EXPECT_NE(
      renderPlanReport(slow.plan, "plan.json")
          .find("network:  net.json: collectives measured on 2 ranks (nccl, test), planned with instead of "
                "the trace's calibration"),
      std::string::npos);
}

TEST(Network, APlanForOneRankOrACalibrationOnAnotherNetworkIsRefused) {
  const schemas::Trace t = oneRankTrace();
  PlanRequest req;
  req.network = twoRanks(1.0);
  req.worldSize = 1;  // one rank's calls are its transport's own copies, which the trace timed
  EXPECT_NE(
      refusal(t, req).find("--network net.json: the collectives between ranks; this plan is for 1 rank"),
      std::string::npos);
  // A replay of a plan made with one network calibrates plans made with that network only.
  req.worldSize = 0;
  const schemas::Plan replayed = makePlan(t, req).plan;
  ReplayMeasurement m;
  m.schedule = scheduleOf(replayed);
  m.worldSize = 2;
  m.stepUs = replayed.predicted.stepUs * 1.2;
  m.description = "replay.0.jsonl (a replay of plan.json)";
  m.network = replayed.options.network;
  req.calibrate = m;
  const PlanResult fitted = makePlan(t, req);
  ASSERT_TRUE(fitted.plan.options.inSituScale);
  EXPECT_GT(*fitted.plan.options.inSituScale, 1.0);
  req.network = twoRanks(2.0);
  EXPECT_NE(
      refusal(t, req).find("the replayed plan was made with --network net.json, this plan with --network "
                           "net.json: a scale fitted to one network's times says nothing of another's"),
      std::string::npos);
  req.network.reset();
  req.worldSize = 2;
  EXPECT_NE(refusal(t, req).find("made with --network net.json, this plan with the trace's calibration"),
            std::string::npos);
}

TEST(Network, AnotherTransportsMeasurementIsRefused) {
  schemas::Trace t = oneRankTrace();
  t.meta.backend = "gloo";
  t.meta.device = "cpu";
  PlanRequest req;
  req.network = twoRanks(1.0);  // NCCL's
  EXPECT_NE(refusal(t, req).find("--network net.json: measured on nccl (test), the trace on gloo (cpu)"),
            std::string::npos);
}

}  // namespace
}  // namespace dcplan::planner
