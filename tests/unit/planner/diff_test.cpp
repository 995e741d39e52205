// Tests of the semantic plan diff.
#include <gtest/gtest.h>

#include "dcplan/planner/diff.h"
#include "dcplan/planner/planner.h"
#include "dcplan/planner/report.h"
#include "tiny_trace.h"

namespace dcplan::planner {
namespace {

schemas::Plan tinyPlan() {
  PlanRequest r;
  r.traceName = "tiny.json";
  return makePlan(test::tinyTrace(), r).plan;
}

TEST(Diff, EqualPlans) {
  schemas::Plan a = tinyPlan();
  PlanDiff d = diffPlans(a, a);
  EXPECT_TRUE(d.equal());
  EXPECT_NE(renderDiffText(d, "a", "b").find("plans are equal"), std::string::npos);
}

TEST(Diff, ProvenanceIsANoteNotADifference) {
  schemas::Plan a = tinyPlan(), b = a;
  b.source.traceDigest = "fnv1a64:0000000000000000";
  b.createdBy = "dcplan 9.9.9";
  PlanDiff d = diffPlans(a, b);
  EXPECT_TRUE(d.equal());
  EXPECT_EQ(d.notes.size(), 2u);
}

TEST(Diff, TheNetworkAPlanWasMadeForIsAnOptionAndItsInSituScaleANote) {
  schemas::Plan a = tinyPlan(), b = a;
  schemas::PlanNetwork net{"net.json", {}};
  net.measured.worldSize = 2;
  net.measured.backend = "nccl";
  net.measured.calibration.allGather = {{1024, 20.0}};
  b.options.network = net;
  PlanDiff d = diffPlans(a, b);
  ASSERT_EQ(d.differences.size(), 1u);
  EXPECT_EQ(d.differences[0].path, "/options/network");
  EXPECT_EQ(d.differences[0].textA, "none");
  EXPECT_EQ(d.differences[0].textB, "net.json (2 ranks, nccl)");
  // The same file name with other times: still a difference, and it says so.
  a.options.network = net;
  b.options.network->measured.calibration.allGather[0].us = 40.0;
  d = diffPlans(a, b);
  ASSERT_EQ(d.differences.size(), 1u);
  EXPECT_EQ(d.differences[0].textB, "net.json (2 ranks, nccl), other times");
  b.options.network = net;
  b.options.inSituScale = 1.5;  // fitted to a recording or a replay: provenance
  d = diffPlans(a, b);
  EXPECT_TRUE(d.equal());
  ASSERT_EQ(d.notes.size(), 1u);
  EXPECT_EQ(d.notes[0].path, "/options/in_situ_scale");
  b.options.hostScale = 0.73;  // fitted to a replay: provenance too
  d = diffPlans(a, b);
  EXPECT_TRUE(d.equal());
  ASSERT_EQ(d.notes.size(), 2u);
  EXPECT_EQ(d.notes[1].path, "/options/host_scale");
}

TEST(Diff, ScheduleChangesArePinnedByPointer) {
  schemas::Plan a = tinyPlan(), b = a;
  b.persistent = {1};
  a.persistent = {0};
  b.graphs[0].prefetch = {{0, {0, 1}}};
  a.graphs[0].prefetch.clear();
  b.graphs[1].buckets = {{{1}, 102'400, "float32"}, {{0}, 102'400, "float32"}};
  a.graphs[1].buckets = {{{1, 0}, 204'800, "float32"}};
  PlanDiff d = diffPlans(a, b);
  ASSERT_FALSE(d.equal());
  std::vector<std::string> paths;
  for (const auto& x : d.differences) paths.push_back(x.path);
  EXPECT_NE(std::find(paths.begin(), paths.end(), "/persistent"), paths.end());
  EXPECT_NE(std::find(paths.begin(), paths.end(), "/graphs/0/prefetch/0"), paths.end());
  EXPECT_NE(std::find(paths.begin(), paths.end(), "/graphs/1/buckets/0"), paths.end());
  EXPECT_NE(std::find(paths.begin(), paths.end(), "/graphs/1/buckets/1"), paths.end());
  std::string text = renderDiffText(d, "a", "b");
  EXPECT_NE(text.find("+ persistent: [1]"), std::string::npos) << text;
  EXPECT_NE(text.find("- persistent: [0]"), std::string::npos) << text;
  EXPECT_NE(text.find("+ graph 0 (forward) prefetch @0: [0-1]"), std::string::npos) << text;
  std::string json = renderDiffJson(d, "a", "b", 0);
  EXPECT_NE(json.find("\"equal\": false"), std::string::npos);
}

TEST(Diff, SavedActivationsMovedToTheHostAreNamedByFirstSave) {
  schemas::Plan a = tinyPlan(), b = a;
  a.graphs[0].offloadSaves = {{0, 4096}, {3, 4096}};
  b.graphs[0].offloadSaves = {{3, 4096}, {5, 8192}, {6, 8192}};
  b.predicted.activationOffloadBytes = 20'480;
  PlanDiff d = diffPlans(a, b);
  std::string text = renderDiffText(d, "a", "b");
  EXPECT_NE(text.find("+ graph 0 (forward) offloaded saves: [5-6]"), std::string::npos) << text;
  EXPECT_NE(text.find("- graph 0 (forward) offloaded saves: [0]"), std::string::npos) << text;
  EXPECT_NE(text.find("predicted activation_offload_bytes"), std::string::npos) << text;
  EXPECT_TRUE(diffPlans(b, b).equal());
}

TEST(Diff, PredictionsWithinToleranceAreEqual) {
  schemas::Plan a = tinyPlan(), b = a;
  b.predicted.stepUs = a.predicted.stepUs * 1.004;
  EXPECT_FALSE(diffPlans(a, b).equal());
  EXPECT_TRUE(diffPlans(a, b, 0.005).equal());
  EXPECT_FALSE(diffPlans(a, b, 0.003).equal());
}

TEST(Diff, RecordedInputsTravelIntoThePlanAndItsDiffAndReport) {
  schemas::Trace t = test::tinyTrace();
  for (schemas::TraceStep& step : t.steps) step.graphs[0].inputShapes = schemas::InputShapes{{2, 64}};
  PlanRequest r;
  r.traceName = "tiny.json";
  const schemas::Plan withInputs = makePlan(t, r).plan;
  ASSERT_EQ(withInputs.graphs.size(), 2u);
  EXPECT_EQ(withInputs.graphs[0].inputShapes, (schemas::InputShapes{{2, 64}}));
  EXPECT_FALSE(withInputs.graphs[1].inputShapes.has_value());  // backward graphs have none
  EXPECT_NE(renderPlanReport(withInputs, "p.json").find("recorded inputs [(2, 64)]"), std::string::npos);
  schemas::Plan bigger = withInputs;
  bigger.graphs[0].inputShapes = schemas::InputShapes{{4, 64}, {4}};
  const std::string text = renderDiffText(diffPlans(withInputs, bigger), "a", "b");
  EXPECT_NE(text.find("[(2, 64)]"), std::string::npos) << text;
  EXPECT_NE(text.find("[(4, 64), (4,)]"), std::string::npos) << text;
  EXPECT_FALSE(diffPlans(withInputs, bigger).equal());
  EXPECT_FALSE(diffPlans(tinyPlan(), withInputs).equal());  // "not recorded" against recorded
}

TEST(Diff, FormatIds) {
  EXPECT_EQ(formatIds({3, 4, 5, 6, 9, 12, 13}), "3-6 9 12-13");
  EXPECT_EQ(formatIds({5, 4, 3}), "5 4 3");
  EXPECT_EQ(formatIds({}), "");
}

}  // namespace
}  // namespace dcplan::planner
