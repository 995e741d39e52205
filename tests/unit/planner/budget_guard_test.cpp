// What the runtime's budget guard reads from a plan (planner/budget_guard.h): each prefetch group's
// peak_bytes, and guard.start_bytes and persistent_peak_bytes.
#include <gtest/gtest.h>

#include <algorithm>

#include "dcplan/planner/budget_guard.h"
#include "dcplan/planner/planner.h"
#include "dcplan/planner/simulator.h"
#include "tiny_trace.h"

namespace dcplan::planner {
namespace {

using schemas::GraphKind;
using test::kTinyBase;
using test::kTinyParam;

/// The tiny trace's step under `plan`'s schedule, simulated with the memory recorded.
SimResult recorded(const Workload& w, const schemas::Trace& t, const schemas::Plan& plan) {
  CostModel cost{t.calibration, 2};
  Schedule s;
  s.persistent = plan.persistent;
  s.graphs = plan.graphs;
  SimOptions record;
  record.record = true;
  return simulate(w, cost, compileSchedule(w, s), record);
}

/// The most memory of the samples of run `run` from position `from` (the compute before it left
/// out) to `until`.
uint64_t peakOf(const SimResult& sim, int32_t run, int64_t from, int64_t until) {
  uint64_t peak = 0;
  for (const MemorySample& m : sim.memory) {
    if (m.run == run && m.seq >= 0 && (m.atOp ? m.seq >= from : m.seq > from) && m.seq <= until)
      peak = std::max(peak, m.bytes);
  }
  return peak;
}

TEST(BudgetGuardPeaks, APrefetchHoldsItsPeakFromTheLaunchToItsLastMembersGather) {
  schemas::Trace t = test::tinyTrace();
  Workload w = makeWorkload(t);
  schemas::Plan plan;
  // Forward: parameter 1 launched before op 0 (gather 0); its own gather is op 3.
  // Backward: parameter 0 launched before op 2 (reduce_grad 1); its own gather is op 4.
  plan.graphs = {{0, GraphKind::Forward, {{0, {1}}}, {}},
                 {1, GraphKind::Backward, {{2, {0}}}, {{{1, 0}, 0, "float32"}}}};
  const SimResult sim = recorded(w, t, plan);
  setGuardPeaks(w, sim, plan);
  // Both parameters gathered from op 0 on, over the baseline.
  EXPECT_EQ(*plan.graphs[0].prefetch[0].peakBytes, kTinyBase + 2 * kTinyParam);
  EXPECT_EQ(*plan.graphs[1].prefetch[0].peakBytes, peakOf(sim, 1, 2, 4));
  EXPECT_GE(*plan.graphs[1].prefetch[0].peakBytes, kTinyBase + 2 * kTinyParam);
  ASSERT_TRUE(plan.guard.has_value());
  EXPECT_EQ(plan.guard->startBytes, kTinyBase);  // entering the forward's first op
  EXPECT_TRUE(plan.guard->persistentPeakBytes.empty());
}

TEST(BudgetGuardPeaks, AKeptCopyHoldsItsPeakFromItsReleaseToItsNextGather) {
  schemas::Trace t = test::tinyTrace();
  Workload w = makeWorkload(t);
  schemas::Plan plan;
  plan.persistent = {0};
  plan.graphs = {{0, GraphKind::Forward, {}, {}}, {1, GraphKind::Backward, {}, {{{1, 0}, 0, "float32"}}}};
  const SimResult sim = recorded(w, t, plan);
  setGuardPeaks(w, sim, plan);
  ASSERT_TRUE(plan.guard.has_value());
  ASSERT_EQ(plan.guard->persistentPeakBytes.size(), 1u);
  // Kept at the forward's release (op 2), gathered again by the backward's op 4: the rest of the
  // forward and the backward up to there.
  // The most: backward op 2, where 0 (kept) and 1 are gathered and 1's gradient waits in its bucket.
  EXPECT_EQ(plan.guard->persistentPeakBytes[0], kTinyBase + 3 * kTinyParam);
  EXPECT_EQ(plan.guard->persistentPeakBytes[0], std::max(peakOf(sim, 0, 2, 5), peakOf(sim, 1, -1, 4)));
  // A frozen persistent copy outlives the step at runtime: the step starts with it.
  t.params[0].requiresGrad = false;
  Workload frozen = makeWorkload(t);
  schemas::Plan again = plan;
  setGuardPeaks(frozen, recorded(frozen, t, again), again);
  EXPECT_EQ(again.guard->startBytes, plan.guard->startBytes + kTinyParam);
  t.params[0].requiresGrad = true;
  // ZeRO-1/2 keep every copy by their stage: nothing for the guard to drop.
  t.meta.stage = 2;
  Workload w2 = makeWorkload(t);
  setGuardPeaks(w2, recorded(w2, t, plan), plan);
  EXPECT_EQ(plan.guard->persistentPeakBytes, std::vector<uint64_t>{0});
}

TEST(BudgetGuardPeaks, NeedARecordedSimulation) {
  schemas::Trace t = test::tinyTrace();
  Workload w = makeWorkload(t);
  CostModel cost{t.calibration, 2};
  schemas::Plan plan;
  plan.graphs = {{0, GraphKind::Forward, {{0, {1}}}, {}},
                 {1, GraphKind::Backward, {}, {{{1, 0}, 0, "float32"}}}};
  Schedule s;
  s.graphs = plan.graphs;
  EXPECT_THROW(setGuardPeaks(w, simulate(w, cost, compileSchedule(w, s)), plan), std::logic_error);
}

TEST(BudgetGuardPeaks, OnlyPlansUnderABudgetCarryThem) {
  schemas::Trace t = test::tinyTrace();
  PlanRequest req;
  const schemas::Plan free = makePlan(t, req).plan;
  EXPECT_FALSE(free.guard.has_value());
  for (const auto& g : free.graphs) {
    for (const auto& group : g.prefetch) EXPECT_FALSE(group.peakBytes.has_value());
  }
  req.memoryBudgetBytes = 10'000'000;
  const schemas::Plan budgeted = makePlan(t, req).plan;
  ASSERT_TRUE(budgeted.guard.has_value());
  EXPECT_EQ(budgeted.guard->persistentPeakBytes.size(), budgeted.persistent.size());
  size_t groups = 0;
  for (const auto& g : budgeted.graphs) {
    for (const auto& group : g.prefetch) {
      ++groups;
      ASSERT_TRUE(group.peakBytes.has_value());
      EXPECT_LE(*group.peakBytes, budgeted.predicted.peakMemoryBytes);  // a window of the step
    }
  }
  EXPECT_GT(groups, 0u) << "the budgeted plan should prefetch (ample memory, exposed gathers)";
}

}  // namespace
}  // namespace dcplan::planner
