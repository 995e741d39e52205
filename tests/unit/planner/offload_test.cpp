// Planned offload of optimizer state and master shards: the groups, the optimizer step's copies,
// the memory it saves, and the planner's choice under a budget no schedule meets with the state on
// the device, or with all of it offloaded.
#include <gtest/gtest.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "dcplan/planner/offload.h"
#include "dcplan/planner/planner.h"
#include "dcplan/planner/report.h"
#include "dcplan/planner/simulator.h"
#include "tiny_trace.h"

namespace dcplan::planner {
namespace {

using schemas::GraphKind;
using test::kTinyBase;
using test::kTinyParam;
using test::kTinyShard;

using test::offloadableTrace;

constexpr uint64_t kState = test::kTinyState;

struct Fixture {
  schemas::Trace trace = offloadableTrace();
  Workload w = makeWorkload(trace);
  CostModel cost{trace.calibration, 2};

  /// forwardPrefetch: the forward's prefetch groups (none: every gather on use).
  SimResult run(std::vector<schemas::OffloadGroup> offload, bool record = false,
                std::vector<schemas::PrefetchGroup> forwardPrefetch = {}) const {
    Schedule s;
    s.graphs.push_back({0, GraphKind::Forward, std::move(forwardPrefetch), {}});
    s.graphs.push_back({1, GraphKind::Backward, {}, {{{1, 0}, 0, "float32"}}});
    s.optimizerOffload = std::move(offload);
    SimOptions o;
    o.record = record;
    return simulate(w, cost, compileSchedule(w, s), o);
  }
};

TEST(Offload, StateLeavesTheDeviceOutsideTheOptimizerStep) {
  Fixture f;
  SimResult kept = f.run({});
  SimResult off = f.run({{{0}, kState}, {{1}, kState}});
  // The backward's peak (gathered 0, both gradients and their bucket) less both shards' state;
  // in the optimizer step both groups are back at once (one updated, the next coming in), which
  // with the two gradient shards stays under it.
  EXPECT_EQ(kept.prediction.peakMemoryBytes, kTinyBase + 5 * kTinyParam);
  EXPECT_EQ(off.prediction.peakMemoryBytes, kTinyBase + 5 * kTinyParam - 2 * kState);
  EXPECT_EQ(off.prediction.offloadBytes, 2 * kState);
  EXPECT_EQ(kept.prediction.offloadBytes, 0u);
}

TEST(Offload, CopiesRunBesideTheUpdatesOneStreamEachWay) {
  Fixture f;
  SimResult kept = f.run({});
  SimResult off = f.run({{{0}, kState}, {{1}, kState}});
  // From the optimizer's start S: group 0 in [S, S+102.4], updated to S+127.4 (half of 50 us),
  // out [S+127.4, S+332.2]; group 1 in [S+102.4, S+204.8], updated to S+229.8, out once the
  // stream is free [S+332.2, S+537]. The step ends with the last copy out: 537 us after S
  // where 50 us was the optimizer alone.
  EXPECT_NEAR(off.prediction.stepUs - kept.prediction.stepUs, 537 - 50, 1e-6);
  EXPECT_NEAR(off.prediction.reloadUs, 2 * 102.4, 1e-9);
  EXPECT_NEAR(off.prediction.offloadUs, 2 * 204.8, 1e-9);
  EXPECT_NEAR(off.prediction.exposedCopyUs, 487, 1e-6);
  // The copies are not communication: exposed communication is the same step's without them.
  EXPECT_NEAR(off.prediction.exposedCommUs, kept.prediction.exposedCommUs, 1e-6);
}

TEST(Offload, ResidentParametersUpdateWhileTheFirstGroupComesIn) {
  Fixture f;
  CompiledOffload one = compileOffload(f.w, {{{1}, kState}});
  EXPECT_DOUBLE_EQ(one.share, 0.5);
  EXPECT_EQ(one.stepBytes, kState);
  OptimizerPhase ph = simulateOptimizerPhase(f.w, f.cost, one, 1000, false);
  // Parameter 0 (25 us) runs during the copy in (102.4 us), then 1's 25 us, then its copy out.
  EXPECT_NEAR(ph.endUs, 1000 + 102.4 + 25 + 204.8, 1e-9);
  // On CPU ranks one thread does it all in turn.
  OptimizerPhase serial = simulateOptimizerPhase(f.w, f.cost, one, 1000, true);
  EXPECT_NEAR(serial.endUs, 1000 + 50 + 102.4 + 204.8, 1e-9);
  EXPECT_NEAR(serial.exposedUs, 102.4 + 204.8, 1e-9);
}

TEST(Offload, AForeachOptimizersTemporariesShrinkWithWhatACallSteps) {
  // The optimizer step peaks 1 MB above the step's first op; less the two gradient shards it
  // holds, 897,600 bytes of temporaries. Stepped group by group, a foreach optimizer's largest
  // call steps half of the state (each offload group is one of two equal parameters of one param
  // group), so half of them; a per-parameter loop's, a fused step's (in place), or an optimizer
  // not recorded, are kept whole.
  auto peak = [](const char* impl, const char* other) {
    Fixture f;
    schemas::OpEvent& first = f.trace.steps[0].graphs[0].events[0];
    first.peakBytes = first.memoryBytes + 1'000'000;
    f.trace.params[0].optimizerImpl = impl;
    f.trace.params[1].optimizerImpl = other;
    for (auto& p : f.trace.params) p.optimizerGroup = 0;
    f.w = makeWorkload(f.trace);
    return f.run({{{0}, kState}, {{1}, kState}}).prediction.peakMemoryBytes;
  };
  const uint64_t whole = peak("for_loop", "for_loop");
  EXPECT_EQ(whole - peak("foreach", "foreach"), (1'000'000 - 2 * kTinyShard) / 2);
  EXPECT_EQ(peak("fused", "fused"), whole);
  EXPECT_EQ(peak("foreach", "fused"), whole);
  EXPECT_EQ(peak("foreach", "for_loop"), whole);  // one loop among them: its call is not known
}

TEST(Offload, AForeachOptimizerCallsOncePerParamGroup) {
  Fixture f;
  for (auto& p : f.trace.params) {
    p.optimizerImpl = "foreach";
    p.optimizerGroup = 0;
  }
  f.w = makeWorkload(f.trace);
  EXPECT_DOUBLE_EQ(compileOffload(f.w, {{{0}, kState}, {{1}, kState}}).scratchShare, 0.5);
  // Parameter 0 kept on the device is a call of its own, as large as offload group 1.
  EXPECT_DOUBLE_EQ(compileOffload(f.w, {{{1}, kState}}).scratchShare, 0.5);
  EXPECT_DOUBLE_EQ(compileOffload(f.w, {{{0, 1}, 2 * kState}}).scratchShare, 1.0);
  // Each parameter in a param group of its own: the recorded step's calls were one parameter
  // each already, as the grouped step's are.
  f.trace.params[1].optimizerGroup = 1;
  f.w = makeWorkload(f.trace);
  EXPECT_DOUBLE_EQ(compileOffload(f.w, {{{0}, kState}, {{1}, kState}}).scratchShare, 1.0);
  EXPECT_DOUBLE_EQ(compileOffload(f.w, {{{0, 1}, 2 * kState}}).scratchShare, 1.0);
  // Not known: an implementation or a param group not recorded.
  f.trace.params[1].optimizerGroup.reset();
  f.w = makeWorkload(f.trace);
  EXPECT_DOUBLE_EQ(compileOffload(f.w, {{{0}, kState}, {{1}, kState}}).scratchShare, 1.0);
  f.trace.params[1].optimizerGroup = 0;
  f.trace.params[1].optimizerImpl.reset();
  f.w = makeWorkload(f.trace);
  EXPECT_DOUBLE_EQ(compileOffload(f.w, {{{0}, kState}, {{1}, kState}}).scratchShare, 1.0);
  // State that does not stand for the elements: more per element on one shard (AMSGrad's third
  // moment, say), or a trainable parameter without state beside the offloaded one.
  f.trace.params[1].optimizerImpl = "foreach";
  f.trace.params[1].optimizerStateBytes = 3 * kTinyShard;
  f.w = makeWorkload(f.trace);
  EXPECT_DOUBLE_EQ(compileOffload(f.w, {{{0}, kState}, {{1}, 3 * kTinyShard}}).scratchShare, 1.0);
  f.trace.params[1].optimizerStateBytes = 0;
  f.w = makeWorkload(f.trace);
  EXPECT_DOUBLE_EQ(compileOffload(f.w, {{{0}, kState}}).scratchShare, 1.0);
}

TEST(Offload, GroupsFollowDsIdsAndStaySmallAgainstTheWhole) {
  Fixture f;
  const std::vector<int32_t> order = offloadOrder(f.w);
  ASSERT_EQ(order.size(), 2u);  // equal state: by ds_id
  EXPECT_EQ(f.w.params[static_cast<size_t>(order[0])].id, 0);
  // 204,800 bytes in all: groups of at least 1/16 of it, so each parameter is its own.
  auto groups = offloadGroups(f.w, order, 2);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].dsIds, std::vector<int64_t>{0});
  EXPECT_EQ(groups[1].bytes, kState);
  EXPECT_EQ(offloadGroups(f.w, order, 1).size(), 1u);
}

TEST(Offload, PlanGroupsThatDoNotFitTheTraceAreRefusedByPointer) {
  Fixture f;
  auto message = [&](std::vector<schemas::OffloadGroup> g) {
    try {
      compileOffload(f.w, g);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(message({{{0, 7}, 0}}),
            "/offload/optimizer_state/0/ds_ids/1: ds_id 7 is not a parameter of the trace");
  EXPECT_EQ(message({{{0}, 0}, {{0}, 0}}), "/offload/optimizer_state/1/ds_ids/0: ds_id 0 is offloaded twice");
  Fixture none;
  none.trace.params[1].optimizerStateBytes.reset();
  none.w = makeWorkload(none.trace);
  EXPECT_THROW(compileOffload(none.w, {{{1}, 0}}), std::invalid_argument);
}

TEST(Offload, WhatATraceLacksForAnOffloadIsNamed) {
  Fixture f;
  EXPECT_EQ(offloadUnavailable(f.w, f.cost), "");
  schemas::Trace noRate = offloadableTrace();
  noRate.calibration.d2hGBps.reset();
  EXPECT_EQ(
      offloadUnavailable(makeWorkload(noRate), CostModel{noRate.calibration, 2}),
      "the trace's calibration has no host link rate (h2d_gbps, d2h_gbps): record again to plan an offload");
  schemas::Trace frozen = offloadableTrace();
  for (auto& p : frozen.params) p.requiresGrad = false;
  EXPECT_EQ(offloadUnavailable(makeWorkload(frozen), f.cost),
            "no trainable parameter has params[].optimizer_state_bytes > 0 in the trace");
  const std::string missing = offloadUnavailable(makeWorkload(test::tinyTrace()), f.cost);
  EXPECT_EQ(missing.rfind("the trace has no optimizer_state_bytes", 0), 0u) << missing;
}

TEST(Offload, PlannerOffloadsOnlyUnderABudgetNoScheduleMeetsOnTheDevice) {
  const schemas::Trace t = offloadableTrace();
  PlanRequest req;
  req.memoryBudgetBytes = 1'600'000;  // the gather-on-use floor, 1,512,000, fits
  EXPECT_TRUE(makePlan(t, req).plan.optimizerOffload.empty());
  // 1,400,000 less the reserve: one shard's state off (1,409,600) is not enough, both are.
  req.memoryBudgetBytes = 1'400'000;
  req.explain = true;
  PlanResult r = makePlan(t, req);
  ASSERT_EQ(r.plan.optimizerOffload.size(), 2u);
  EXPECT_LE(r.plan.predicted.peakMemoryBytes, plannedLimit(1'400'000));
  EXPECT_EQ(r.plan.predicted.offloadBytes, 2 * kState);
  // The copy bound: the plan without a budget's step, or the host link's busier direction.
  const schemas::Prediction& p = r.plan.predicted;
  EXPECT_EQ(p.unconstrainedStepUs, makePlan(t, PlanRequest{}).plan.predicted.stepUs);
  EXPECT_GT(p.unconstrainedStepUs, 0.0);
  EXPECT_EQ(p.copyInUs, p.reloadUs);  // no saved activation moves
  EXPECT_EQ(p.copyOutUs, p.offloadUs);
  EXPECT_EQ(p.copyBoundUs, std::max({p.unconstrainedStepUs, p.copyInUs, p.copyOutUs}));
  EXPECT_EQ(copyBoundLine(p).rfind("copy bound: ", 0), 0u) << copyBoundLine(p);
  EXPECT_EQ(copyBoundLine(schemas::Prediction{}), "");  // a plan without offload has none
  bool explained = false;
  for (const std::string& line : r.explanation) explained |= line.rfind("offload: no schedule fits", 0) == 0;
  EXPECT_TRUE(explained);
  // Below what the plan needs with all of it offloaded: refused, naming that floor.
  req.memoryBudgetBytes = 1'200'000;
  try {
    makePlan(t, req);
    FAIL() << "a budget under the all-offloaded floor was planned";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(
        std::string(e.what()).find("below what any plan needs with all optimizer state offloaded (200 KiB): "
                                   "at least 1.25 MiB"),
        std::string::npos)
        << e.what();
  }
}

TEST(Offload, MasterShardsLeaveTheDeviceBetweenTheirGathers) {
  Fixture f;
  SimResult state = f.run({{{0}, kState}, {{1}, kState}});
  SimResult masters = f.run({{{0}, kState, kTinyShard}, {{1}, kState, kTinyShard}});
  // Each shard is back only from its gather's issue to its wait: the backward's peak (gathered 0,
  // both gradients and their bucket) holds neither; the optimizer step holds the one updated.
  EXPECT_EQ(masters.prediction.peakMemoryBytes, state.prediction.peakMemoryBytes - 2 * kTinyShard);
  EXPECT_EQ(masters.prediction.offloadBytes, 2 * kState + 2 * kTinyShard);
  // Every gather first copies its shard in (51.2 us at 1 GB/s) and waits for it; gathered on use,
  // the compute waits for both: all of the copies added to the step, none of them communication.
  EXPECT_NEAR(masters.masterReloadUs, 51.2 * static_cast<double>(masters.gatherCalls), 1e-9);
  EXPECT_GE(masters.gatherCalls, 2);
  // In the optimizer step each group's shard comes in before its update and goes out after it.
  EXPECT_NEAR(masters.prediction.reloadUs, state.prediction.reloadUs + masters.masterReloadUs + 2 * 51.2,
              1e-6);
  EXPECT_NEAR(masters.prediction.offloadUs, state.prediction.offloadUs + 2 * 102.4, 1e-6);
  EXPECT_GE(masters.prediction.stepUs, state.prediction.stepUs + masters.masterReloadUs);
  EXPECT_NEAR(masters.prediction.exposedCommUs, state.prediction.exposedCommUs, 1e-6);
}

TEST(Offload, APrefetchedMasterShardComesInBesideTheCompute) {
  Fixture f;
  const std::vector<schemas::OffloadGroup> both = {{{0}, kState, kTinyShard}, {{1}, kState, kTinyShard}};
  // Both gathered at the forward's start: on a GPU the reload stream copies 1's shard while 0's
  // gather runs, so only 0's copy holds the compute up; then the backward gathers 1 again on use.
  const SimResult gpu = f.run(both, true, {{0, {0}}, {0, {1}}});
  EXPECT_NEAR(gpu.masterReloadUs, 51.2 * static_cast<double>(gpu.gatherCalls), 1e-9);
  EXPECT_LT(gpu.masterReloadExposedUs, gpu.masterReloadUs - 51.2 + 1e-9);
  bool onReloadStream = false;
  for (const TimelineEvent& e : gpu.timeline) {
    if (e.name == "reload master shards") onReloadStream = e.stream == Stream::Reload;
  }
  EXPECT_TRUE(onReloadStream);
  // On CPU ranks the host copies, in its turn: all of it added, prefetched or not.
  Fixture gloo;
  gloo.trace.meta.backend = "gloo";
  gloo.w = makeWorkload(gloo.trace);
  const SimResult cpu = gloo.run(both, false, {{0, {0}}, {0, {1}}});
  EXPECT_NEAR(cpu.masterReloadExposedUs, cpu.masterReloadUs, 1e-9);
  EXPECT_GT(cpu.masterReloadUs, 0.0);
}

TEST(Offload, AMasterShardIsBackFromItsGathersIssueToItsWait) {
  Fixture f;
  SimResult state = f.run({{{0}, kState}, {{1}, kState}}, /*record=*/true);
  SimResult masters = f.run({{{0}, kState, kTinyShard}, {{1}, kState, kTinyShard}}, /*record=*/true);
  ASSERT_EQ(state.memory.size(), masters.memory.size());
  // Both shards are off the baseline except while one is brought back for a gather (each gather
  // is waited on at the next op here, so one at a time) or for its update.
  size_t inGather = 0;
  for (size_t i = 0; i < state.memory.size(); ++i) {
    const uint64_t saved = state.memory[i].bytes - masters.memory[i].bytes;
    EXPECT_TRUE(saved == 2 * kTinyShard || saved == kTinyShard) << "sample " << i << ": " << saved;
    inGather += saved == kTinyShard && masters.memory[i].run >= 0;
  }
  EXPECT_GE(inGather, 2u);  // a gather of each parameter at least
}

TEST(Offload, MasterShardsAreRefusedWhereTheRuntimeCannotKeepThem) {
  PlanRequest req;
  req.memoryBudgetBytes = 1'300'000;  // under the all-state floor: masters are needed (the test below)
  schemas::Trace zero2 = offloadableTrace();
  zero2.meta.stage = 2;
  schemas::Trace compiled = offloadableTrace();
  compiled.meta.replay = "compiled";
  for (const schemas::Trace& t : {zero2, compiled}) {
    try {
      makePlan(t, req);
      FAIL() << "master shards planned for stage " << t.meta.stage << ", replay " << t.meta.replay;
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("below what any plan needs with all optimizer state offloaded ("),
                std::string::npos)
          << what;
      EXPECT_NE(
          what.find(t.meta.stage == 2 ? "; master shards are offloaded under ZeRO-3 only"
                                      : "; master shards kept on the host are planned for an eager replay "
                                        "only"),
          std::string::npos)
          << what;
    }
  }
}

TEST(Offload, MasterShardsAreOffloadedUnderZero3Only) {
  schemas::Trace t = offloadableTrace();
  t.meta.stage = 2;
  const Workload w = makeWorkload(t);
  EXPECT_NO_THROW(compileOffload(w, {{{0}, kState}}));
  try {
    compileOffload(w, {{{0}, kState}, {{1}, kState, kTinyShard}});
    FAIL() << "a ZeRO-2 plan offloaded master shards";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "/offload/optimizer_state/1/master_bytes: master shards are offloaded under ZeRO-3 only; the "
              "trace is ZeRO-2");
  }
}

TEST(Offload, MastersOfTheGroupsWithTheMostOfThemGoFirst) {
  const schemas::Trace t = offloadableTrace();
  const Workload w = makeWorkload(t);
  const std::vector<schemas::OffloadGroup> groups = offloadMasters(w, {{{0}, kState}, {{1}, kState}}, 1);
  // Equal shards: the earlier group first.
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].masterBytes, kTinyShard);
  EXPECT_EQ(groups[1].masterBytes, 0u);
  EXPECT_EQ(offloadMasters(w, groups, 0)[0].masterBytes, 0u);
}

TEST(Offload, PlannerOffloadsMasterShardsBelowTheAllStateFloor) {
  const schemas::Trace t = offloadableTrace();
  PlanRequest req;
  // Under the all-state floor (1.25 MiB, above): one group's master shard is enough.
  req.memoryBudgetBytes = 1'300'000;
  req.explain = true;
  PlanResult r = makePlan(t, req);
  ASSERT_EQ(r.plan.optimizerOffload.size(), 2u);
  EXPECT_EQ(r.plan.optimizerOffload[0].masterBytes + r.plan.optimizerOffload[1].masterBytes, kTinyShard);
  EXPECT_LE(r.plan.predicted.peakMemoryBytes, plannedLimit(1'300'000));
  bool explained = false;
  for (const std::string& line : r.explanation) {
    explained |= line.rfind("offload: no schedule fits with all optimizer state offloaded either", 0) == 0;
  }
  EXPECT_TRUE(explained);
  // Below what the plan needs with every master shard offloaded too: refused, naming both floors.
  req.memoryBudgetBytes = 1'000'000;
  try {
    makePlan(t, req);
    FAIL() << "a budget under the all-offloaded floor was planned";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(
        std::string(e.what()).find("; and with the master shards offloaded too (100 KiB more): at least "),
        std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace dcplan::planner
