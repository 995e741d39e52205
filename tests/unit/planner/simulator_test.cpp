// Tests of the simulator's timeline and memory rules on a trace with round numbers.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <stdexcept>

#include "dcplan/planner/in_situ.h"
#include "dcplan/planner/planner.h"
#include "dcplan/planner/report.h"
#include "dcplan/planner/simulator.h"
#include "dcplan/planner/workload.h"
#include "dcplan/planner/units.h"
#include "dcplan/schemas/io.h"
#include "dcplan/schemas/units.h"

#include <nlohmann/json.hpp>
#include "dcplan/testing/trace_generator.h"
#include "tiny_trace.h"

namespace dcplan::planner {
namespace {

using schemas::GraphKind;
using test::kTinyBase;
using test::kTinyGatherUs;
using test::kTinyParam;
using test::kTinyShard;

struct Fixture {
  schemas::Trace trace = test::tinyTrace();
  Workload w = makeWorkload(trace);
  CostModel cost{trace.calibration, 2};

  Schedule onUse(std::vector<std::vector<int64_t>> buckets = {{1, 0}}) const {
    Schedule s;
    s.graphs.push_back({0, GraphKind::Forward, {}, {}});
    schemas::PlanGraph b{1, GraphKind::Backward, {}, {}};
    for (auto& ids : buckets) b.buckets.push_back({ids, 0, "float32"});
    s.graphs.push_back(b);
    return s;
  }
  SimResult run(const Schedule& s, bool record = false) const {
    return simulate(w, cost, compileSchedule(w, s), SimOptions{record});
  }
};

TEST(Simulator, GatherOnUseExposesEveryGatherAndTheReduceTail) {
  Fixture f;
  SimResult r = f.run(f.onUse());
  double rs = f.cost.us(Collective::ReduceScatter, 2 * kTinyParam);
  EXPECT_NEAR(r.computeUs, 3000, 1e-9);
  EXPECT_NEAR(r.prediction.stepUs, 4 * kTinyGatherUs + 3000 + rs + 50, 1e-6);
  EXPECT_NEAR(r.prediction.exposedCommUs, 4 * kTinyGatherUs + rs, 1e-6);
  EXPECT_EQ(r.gatherCalls, 4);
  EXPECT_EQ(r.reduceCalls, 1);
  // Backward, at reduce_grad of 0, which launches the bucket: gathered 0, both gradients and the
  // bucket they are packed into (then the gradients are freed: its output, two shards, is less).
  EXPECT_EQ(r.prediction.peakMemoryBytes, kTinyBase + kTinyParam + 2 * kTinyParam + 2 * kTinyParam);
}

TEST(Simulator, MemoryCurveFollowsTheRuntimesAllocations) {
  // The simulated memory at each backward op, against what the runtime holds after it.
  Fixture f;
  SimResult r = f.run(f.onUse(), true);
  std::vector<uint64_t> at;
  for (const MemorySample& m : r.memory) {
    if (m.atOp && m.run == 1) at.push_back(m.bytes - kTinyBase);
  }
  const uint64_t p = kTinyParam, held = 2 * kTinyParam + 2 * kTinyShard;  // bucket input and output
  EXPECT_EQ(at, (std::vector<uint64_t>{
                    p,                  // gathered 1
                    p,                  // waited
                    p + p,              // its gradient, held for the bucket
                    p,                  // released 1
                    p + p,              // gathered 0
                    p + p,              // waited
                    p + 2 * p + 2 * p,  // launch: gathered 0, both gradients and their packed bucket
                    held,               // released 0; the gradients freed, the bucket's input and output held
                    held}));            // end_backward: held until it returns
}

TEST(Simulator, CollectivesBeyondTheRecordedRunCostHostTime) {
  Fixture f;
  SimResult one = f.run(f.onUse());            // 4 gathers + 1 bucket: the recorded run's calls
  SimResult two = f.run(f.onUse({{1}, {0}}));  // a bucket per gradient: one call more
  SimOptions counted;
  counted.referenceCalls = one.calls();
  SimResult twoCounted = simulate(f.w, f.cost, compileSchedule(f.w, f.onUse({{1}, {0}})), counted);
  EXPECT_EQ(two.reduceCalls, 2);
  EXPECT_DOUBLE_EQ(twoCounted.launchDeltaUs, kDefaultLaunchUs);
  EXPECT_NEAR(twoCounted.prediction.stepUs, two.prediction.stepUs + kDefaultLaunchUs, 1e-9);
  EXPECT_NEAR(twoCounted.prediction.exposedCommUs, two.prediction.exposedCommUs, 1e-9);
  // Fewer calls than recorded earn nothing: the trace cannot say the host was the bottleneck.
  counted.referenceCalls = 10;
  EXPECT_NEAR(simulate(f.w, f.cost, compileSchedule(f.w, f.onUse()), counted).prediction.stepUs,
              one.prediction.stepUs, 1e-9);
  // The cost is a setting of the cost model.
  CostModel free(f.trace.calibration, 2, CostModelOptions{0, std::nullopt, 0.0});
  counted.referenceCalls = 5;
  EXPECT_NEAR(simulate(f.w, free, compileSchedule(f.w, f.onUse({{1}, {0}})), counted).prediction.stepUs,
              two.prediction.stepUs, 1e-9);
}

/// The tiny trace with host times: each stretch of compute takes `hostShare` of its device time
/// on the host, each op `issueUs` (waits `waitIssueUs`), the optimizer `optimizerHostUs`; the
/// device's own compute is scaled by `deviceShare`.
schemas::Trace withHostTimes(double deviceShare, double hostShare, double issueUs, double optimizerHostUs,
                             double waitIssueUs = -1) {
  schemas::Trace t = test::tinyTrace();
  for (schemas::TraceStep& step : t.steps) {
    step.optimizerHostUs = optimizerHostUs;
    for (schemas::TraceGraph& g : step.graphs) {
      for (schemas::OpEvent& e : g.events) {
        e.hostUs = hostShare * e.computeUs;
        e.computeUs *= deviceShare;
        e.issueUs = e.op == "wait_allgather" && waitIssueUs >= 0 ? waitIssueUs : issueUs;
      }
    }
  }
  return t;
}

SimResult simulateTrace(const schemas::Trace& t, const Schedule& s, const SimOptions& o = {}) {
  Workload w = makeWorkload(t);
  return simulate(w, CostModel{t.calibration, 2}, compileSchedule(w, s), o);
}

TEST(SimulatorHostLane, AHostFasterThanTheDeviceChangesNothing) {
  Fixture f;
  const schemas::Trace t = withHostTimes(1.0, 0.5, 1.0, 10.0);
  ASSERT_TRUE(makeWorkload(t).hostLane);
  SimResult lane = simulateTrace(t, f.onUse());
  SimResult device = f.run(f.onUse());
  EXPECT_NEAR(lane.prediction.stepUs, device.prediction.stepUs, 1e-9);
  // The device waits for the host's first issue (1 us): the host's, not communication's.
  EXPECT_NEAR(lane.hostBoundUs, 1.0, 1e-9);
  EXPECT_NEAR(lane.prediction.exposedCommUs + lane.hostBoundUs, device.prediction.exposedCommUs, 1e-9);
  // 1,500 us of compute, 15 ops and the optimizer on the host: well inside the device's step.
  EXPECT_NEAR(lane.hostUs, 1500 + 15 * 1.0 + 10, 1e-9);
}

TEST(SimulatorHostLane, AHostBoundStepIsTheHostsTimeAndHidesTheGathers) {
  Fixture f;
  // The device computes in a fifth of the host's time; every op costs the host 20 us.
  const schemas::Trace t = withHostTimes(0.2, 1.0, 20.0, 300.0);
  SimResult r = simulateTrace(t, f.onUse());
  const double host = 3000 + 15 * 20.0 + 300;
  EXPECT_NEAR(r.hostUs, host, 1e-9);
  EXPECT_NEAR(r.prediction.stepUs, host, 1e-9);  // the device waits for the host, not for gathers
  // Without the host times the same device times expose every gather.
  schemas::Trace deviceOnly = t;
  deviceOnly.steps[0].optimizerHostUs.reset();
  SimResult d = simulateTrace(deviceOnly, f.onUse());
  EXPECT_FALSE(makeWorkload(deviceOnly).hostLane);
  EXPECT_NEAR(d.prediction.stepUs,
              4 * kTinyGatherUs + 600 + f.cost.us(Collective::ReduceScatter, 2 * kTinyParam) + 50, 1e-6);
}

/// A host-bound trace (the host takes the device's recorded time, 20 us per op) whose device-lead
/// step measured the device's own compute at `deviceShare` of it and the optimizer at 30 us.
schemas::Trace withDeviceTimes(double deviceShare) {
  schemas::Trace t = withHostTimes(1.0, 1.0, 20.0, 300.0);
  for (schemas::TraceStep& step : t.steps) {
    step.optimizerDeviceUs = 30.0;
    for (schemas::TraceGraph& g : step.graphs) {
      for (schemas::OpEvent& e : g.events) e.deviceUs = deviceShare * e.computeUs;
    }
  }
  return t;
}

TEST(SimulatorCudaGraph, AGraphRunsOnTheDevicesOwnTimesWithoutTheHost) {
  Fixture f;
  const schemas::Trace t = withDeviceTimes(0.2);
  const Workload w = makeWorkload(t, 0, StepReplay::CudaGraph);
  EXPECT_TRUE(w.cudaGraph);
  EXPECT_FALSE(w.hostLane);
  EXPECT_NEAR(w.computeUs(), 600, 1e-9);
  EXPECT_NEAR(w.optimizerUs, 30, 1e-9);
  const CostModel cost{t.calibration, 2, costOptions(w, std::nullopt)};
  EXPECT_EQ(cost.launchUs(), 0.0);  // the graph issues its collectives without the host
  SimResult r = simulate(w, cost, compileSchedule(w, f.onUse()));
  // The device's compute, every gather exposed (gather on use) and the reduce tail: the host's
  // 3,600 us of issuing are gone.
  EXPECT_NEAR(r.prediction.stepUs,
              4 * kTinyGatherUs + 600 + cost.us(Collective::ReduceScatter, 2 * kTinyParam) + 30, 1e-6);
  EXPECT_EQ(r.hostUs, 0.0);
  // The same trace replayed by the hooks takes at least the host's time.
  EXPECT_GE(simulateTrace(t, f.onUse()).prediction.stepUs, 3000 + 15 * 20.0 + 300);
}

TEST(SimulatorCudaGraph, TheOpsOwnDeviceWorkRunsInTheStreamBeforeTheirCollectives) {
  Fixture f;
  const schemas::Trace plain = withDeviceTimes(0.2);
  schemas::Trace t = plain;
  double own = 0;
  for (schemas::TraceGraph& g : t.steps[0].graphs) {
    for (schemas::OpEvent& e : g.events) {
      if (e.op == "allgather_param") e.opDeviceUs = 7.0;  // its own work, before its gather
      if (e.op == "reduce_grad") e.opDeviceUs = 5.0;      // packing, before the bucket's launch
      own += e.opDeviceUs.value_or(0);
    }
  }
  ASSERT_GT(own, 0);
  const Workload w = makeWorkload(t, 0, StepReplay::CudaGraph);
  EXPECT_NEAR(w.computeUs(), 600 + own, 1e-9);  // device work, not exposed communication
  const CostModel cost{t.calibration, 2, costOptions(w, std::nullopt)};
  const SimResult with = simulate(w, cost, compileSchedule(w, f.onUse()));
  const Workload wPlain = makeWorkload(plain, 0, StepReplay::CudaGraph);
  const SimResult without = simulate(wPlain, cost, compileSchedule(wPlain, f.onUse()));
  // Gathered on use, every gather waits for its cast, and the reduce tail for the packing.
  EXPECT_NEAR(with.prediction.stepUs - without.prediction.stepUs, own, 1e-6);
  EXPECT_NEAR(with.prediction.exposedCommUs, without.prediction.exposedCommUs, 1e-6);
  // The hooks' plan on a GPU runs it on the device too (its own times beside the host's); this
  // step is host-bound, so the host's time it stays.
  EXPECT_FALSE(makeWorkload(t).runs[0].opDeviceUs.empty());
  EXPECT_NEAR(simulateTrace(t, f.onUse()).prediction.stepUs,
              simulateTrace(plain, f.onUse()).prediction.stepUs, 1e-9);
}

TEST(SimulatorCudaGraph, TheCapturedStepsTimeScalesTheDevicesOwnTimes) {
  schemas::Trace t = withDeviceTimes(0.2);
  // The collectives timed on the device too, as a GPU recording has them (at their host times here).
  for (auto* curve : {&t.calibration.allGather, &t.calibration.reduceScatter, &t.calibration.allReduce}) {
    for (auto& p : *curve) p.deviceUs = p.us;
  }
  const Workload raw = makeWorkload(t, 0, StepReplay::CudaGraph);
  const CostModel cost = plannedCostModel(t, raw, std::nullopt);
  const double recorded = simulate(raw, cost, compileSchedule(raw, defaultSchedule(raw))).prediction.stepUs;
  // Without the captured step's time, the device-lead step's times as they are.
  std::optional<CapturedStep> fit;
  Workload w = plannedWorkload(t, 0, StepReplay::CudaGraph, nullptr, nullptr, &fit);
  EXPECT_FALSE(fit.has_value());
  EXPECT_NEAR(w.computeUs(), raw.computeUs(), 1e-9);

  // The graph replayed the recorded (default) schedule 10% under its simulation on them.
  t.calibration.graphStepUs = 0.9 * recorded;
  w = plannedWorkload(t, 0, StepReplay::CudaGraph, nullptr, nullptr, &fit);
  ASSERT_TRUE(fit.has_value());
  EXPECT_FALSE(fit->atBound);
  EXPECT_NEAR(fit->simulatedUs, recorded, 1e-6);
  EXPECT_NEAR(fit->measuredUs, 0.9 * recorded, 1e-9);
  // Only the device's times shrink (the gathers' exposed time is the calibration's): by more than 10%.
  EXPECT_LT(fit->scale, 0.9);
  EXPECT_GT(fit->scale, kCapturedScaleMin);
  EXPECT_NEAR(w.computeUs(), fit->scale * raw.computeUs(), 1e-6);
  EXPECT_NEAR(w.optimizerUs, fit->scale * raw.optimizerUs, 1e-9);
  // The recorded schedule on the fitted times is the captured step (bisected to 2^-24 of the log
  // range: well under a microsecond here).
  EXPECT_NEAR(simulate(w, cost, compileSchedule(w, defaultSchedule(w))).prediction.stepUs, 0.9 * recorded, 1e-3);
  PlanRequest graphed;
  graphed.cudaGraph = true;
  graphed.explain = true;
  const PlanResult planned = makePlan(t, graphed);
  EXPECT_NEAR(planned.plan.predictedDefault.stepUs, 0.9 * recorded, 1.0);  // rounded to the microsecond
  EXPECT_TRUE(planned.warnings.empty());
  bool said = false;
  for (const std::string& line : planned.explanation) said = said || line.rfind("captured: the recorded", 0) == 0;
  EXPECT_TRUE(said) << "--explain does not say the fit";
  // dcplan inspect simulates the plan alike, and says so.
  const std::string report = renderPlanReport(planned.plan, "p.json", &t, "t.json");
  EXPECT_NE(report.find("simulated on t.json: step " + schemas::formatMs(planned.plan.predicted.stepUs)),
            std::string::npos)
      << report;
  EXPECT_NE(report.find("every device time at " + formatFixed(fit->scale, 3) + "x"), std::string::npos) << report;
  // A --world-size what-if keeps the scale fitted where the trace was recorded.
  std::optional<CapturedStep> wider;
  plannedWorkload(t, 4, StepReplay::CudaGraph, nullptr, nullptr, &wider);
  ASSERT_TRUE(wider.has_value());
  EXPECT_NEAR(wider->scale, fit->scale, 1e-12);
  // A step the host issues (the hooks' plan) is not the graph's: its device times stay.
  EXPECT_FALSE(capturedStep(t, makeWorkload(t)).has_value());

  // A captured step far from the simulation is beyond what the fit may scale: not applied, and
  // the plan warns, naming the closed loop.
  t.calibration.graphStepUs = 0.1 * recorded;
  w = plannedWorkload(t, 0, StepReplay::CudaGraph, nullptr, nullptr, &fit);
  ASSERT_TRUE(fit.has_value());
  EXPECT_TRUE(fit->atBound);
  EXPECT_NEAR(w.computeUs(), raw.computeUs(), 1e-9);
  const PlanResult warned = makePlan(t, graphed);
  // (This trace's collectives are host-timed: that warning comes too, after.)
  const auto atBound = std::find_if(warned.warnings.begin(), warned.warnings.end(),
                                    [](const std::string& s) { return s.find("not applied") != s.npos; });
  ASSERT_NE(atBound, warned.warnings.end());
  EXPECT_NE(atBound->find("--calibrate"), std::string::npos) << *atBound;
}

TEST(SimulatorHostLane, AGpusEagerStepRunsOnTheDevicesOwnTimesBesideTheHost) {
  Fixture f;
  // Recorded host-bound: the GPU idled through the host's 3,000 us of compute (its compute_us),
  // and the device-lead step measured its own at a fifth of that.
  const schemas::Trace t = withDeviceTimes(0.2);
  Workload w = makeWorkload(t);
  EXPECT_TRUE(w.hostLane);
  EXPECT_TRUE(w.ownDeviceTimes);
  EXPECT_FALSE(w.cudaGraph);
  EXPECT_NEAR(w.computeUs(), 600, 1e-9);
  EXPECT_NEAR(w.optimizerUs, 30, 1e-9);
  const CostModel cost{t.calibration, 2, costOptions(w, std::nullopt)};
  const double host = 3000 + 15 * 20.0 + 300;
  const SimResult bound = simulate(w, cost, compileSchedule(w, f.onUse()));
  EXPECT_NEAR(bound.prediction.stepUs, host, 1e-6);
  // The device's wait for the host is the host's, not communication's (a gather hidden behind the
  // host's pace included): what is exposed is the tail the device runs after the host's issues,
  // the last bucket's reduce-scatter, less what the host alone would have kept the device waiting
  // after its launch: the three issues (20 us each) that follow it before the optimizer.
  EXPECT_NEAR(bound.hostBoundUs + bound.computeUs + bound.optimizerUs + bound.prediction.exposedCommUs, host, 1e-6);
  EXPECT_NEAR(bound.prediction.exposedCommUs, cost.us(Collective::ReduceScatter, 2 * kTinyParam) - 3 * 20.0, 1e-6);
  // A host twice as fast as the recording's (a plan calibrated to a faster replay): the step
  // follows it, the host's 1,800 us and what the device runs after the host issued it (the reduce
  // tail and the optimizer), under the recorded 3,000 us of the device's compute_us alone.
  scaleHost(w, 0.5);
  const double faster = simulate(w, cost, compileSchedule(w, f.onUse())).prediction.stepUs;
  EXPECT_GE(faster, host / 2 - 1e-6);
  EXPECT_LT(faster, host / 2 + kTinyGatherUs + 30 + 1e-6);
  // Without the device's own times for every op, the device lane is the recorded run's, which
  // held the recording host's pace: no faster host can undercut it.
  schemas::Trace partial = t;
  partial.steps[0].graphs[1].events[2].deviceUs.reset();
  Workload p = makeWorkload(partial);
  EXPECT_FALSE(p.ownDeviceTimes);
  scaleHost(p, 0.5);
  EXPECT_GT(simulate(p, cost, compileSchedule(p, f.onUse())).prediction.stepUs, 3000);
  // On CPU ranks the host is the device (Gloo): the recorded times are its own.
  schemas::Trace gloo = t;
  gloo.meta.backend = "gloo";
  EXPECT_FALSE(makeWorkload(gloo).ownDeviceTimes);
}

TEST(SimulatorHostLane, AnEagerPlanSaysItRanTheDevicesOwnTimesAndIsSimulatedAgainAsPlanned) {
  const schemas::Plan plan = makePlan(withDeviceTimes(0.2), PlanRequest{}).plan;
  EXPECT_TRUE(plan.options.deviceTimes);
  schemas::Plan back;
  ASSERT_TRUE(schemas::validatePlan(schemas::parseJson(schemas::writePlan(plan), "p"), back).empty());
  EXPECT_TRUE(back.options.deviceTimes);
  EXPECT_EQ(plannedReplay(back.options), StepReplay::Issued);
  EXPECT_TRUE(plannedWorkload(withDeviceTimes(0.2), 0, plannedReplay(back.options), nullptr).ownDeviceTimes);
  // A plan without it (made before dcplan used the device's own times, or from a trace without
  // them) is simulated again on the recorded compute, as it was made.
  back.options.deviceTimes = false;
  EXPECT_EQ(plannedReplay(back.options), StepReplay::IssuedOnRecordedTimes);
  const Workload recorded = plannedWorkload(withDeviceTimes(0.2), 0, plannedReplay(back.options), nullptr);
  EXPECT_FALSE(recorded.ownDeviceTimes);
  EXPECT_NEAR(recorded.computeUs(), 3000, 1e-9);
  // CPU ranks and a CUDA graph's plan never say it (a graph always runs the device's times).
  schemas::Trace gloo = withDeviceTimes(0.2);
  gloo.meta.backend = "gloo";
  EXPECT_FALSE(makePlan(gloo, PlanRequest{}).plan.options.deviceTimes);
  PlanRequest graphed;
  graphed.cudaGraph = true;
  const schemas::Plan graph = makePlan(withDeviceTimes(0.2), graphed).plan;
  EXPECT_FALSE(graph.options.deviceTimes);
  EXPECT_EQ(plannedReplay(graph.options), StepReplay::CudaGraph);
  nlohmann::json both = schemas::parseJson(schemas::writePlan(graph), "p");
  both["options"]["device_times"] = true;
  schemas::Plan refused;
  const auto diags = schemas::validatePlan(both, refused);
  ASSERT_FALSE(diags.empty());
  EXPECT_EQ(diags.front().pointer, "/options/device_times");
}

TEST(SimulatorCudaGraph, APlanForTheGraphSaysSoAndNeedsTheDevicesTimes) {
  PlanRequest req;
  req.cudaGraph = true;
  const schemas::Plan graph = makePlan(withDeviceTimes(0.2), req).plan;
  EXPECT_TRUE(graph.options.cudaGraph);
  const schemas::Plan hooks = makePlan(withDeviceTimes(0.2), PlanRequest{}).plan;
  EXPECT_FALSE(hooks.options.cudaGraph);
  EXPECT_LT(graph.predicted.stepUs, 0.5 * hooks.predicted.stepUs);
  schemas::Plan back;
  ASSERT_TRUE(schemas::validatePlan(schemas::parseJson(schemas::writePlan(graph), "p"), back).empty());
  EXPECT_TRUE(back.options.cudaGraph);
  // One event without device_us, named by its pointer.
  schemas::Trace missing = withDeviceTimes(0.2);
  missing.steps[0].graphs[1].events[2].deviceUs.reset();
  try {
    makePlan(missing, req);
    FAIL() << "planned without device_us";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("/steps/0/graphs/1/events/2/device_us: a plan for a CUDA graph"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(makePlan(missing, PlanRequest{}));  // the hooks' plan does not need them
}

TEST(SimulatorHostLane, CollectivesAreChargedWhereTheyAreIssued) {
  Fixture f;
  // Every op's recorded host time (50, 45 us) is above the launch cost it may be spared.
  const schemas::Trace hostBound = withHostTimes(0.2, 1.0, 50.0, 300.0);
  const schemas::Trace deviceBound = withHostTimes(1.0, 0.2, 45.0, 10.0);
  for (const schemas::Trace* t : {&hostBound, &deviceBound}) {
    const bool hostBoundStep = t == &hostBound;
    SimResult recorded = simulateTrace(*t, f.onUse(), SimOptions{});
    SimOptions o;
    o.referenceCalls = recorded.calls();
    o.reference = &recorded;
    ASSERT_EQ(recorded.callsAtOp.size(), 15u);
    EXPECT_EQ(recorded.callsAtOp[0], 1);   // gather 0
    EXPECT_EQ(recorded.callsAtOp[12], 1);  // reduce_grad 0 launches the bucket
    // The recorded schedule again: charged nothing.
    EXPECT_NEAR(simulateTrace(*t, f.onUse(), o).prediction.stepUs, recorded.prediction.stepUs, 1e-9);
    // One fused forward prefetch of both: gather 1 at position 3 launches nothing, one call less.
    Schedule fused = f.onUse();
    fused.graphs[0].prefetch = {{0, {0, 1}}};
    SimResult r = simulateTrace(*t, fused, o);
    EXPECT_NEAR(r.launchDeltaUs, -kDefaultLaunchUs, 1e-9);
    // A bucket per gradient: reduce_grad 1 launches one more.
    SimResult two = simulateTrace(*t, f.onUse({{1}, {0}}), o);
    EXPECT_NEAR(two.launchDeltaUs, kDefaultLaunchUs, 1e-9);
    if (hostBoundStep) {  // the host's time is the step's: a call less is 40 us less, one more 40 more
      EXPECT_NEAR(r.prediction.stepUs, recorded.prediction.stepUs - kDefaultLaunchUs, 1e-9);
      EXPECT_NEAR(two.prediction.stepUs, recorded.prediction.stepUs + kDefaultLaunchUs, 1e-9);
    } else {  // the device's: the host's launches are hidden
      EXPECT_NEAR(two.hostUs - simulateTrace(*t, f.onUse(), o).hostUs, kDefaultLaunchUs, 1e-9);
      EXPECT_LT(two.hostUs, two.prediction.stepUs);
      EXPECT_NEAR(two.prediction.stepUs, simulateTrace(*t, f.onUse({{1}, {0}})).prediction.stepUs, 1e-9);
      EXPECT_NEAR(r.prediction.stepUs, simulateTrace(*t, fused).prediction.stepUs, 1e-9);
    }
  }
}

TEST(SimulatorHostLane, AnOpThatLaunchesNothingCostsWhatTheRecordedRunsQuietOpsCost) {
  // Host-bound. The recorded forward gather of param 1 stalled the host for 2 ms beside its
  // launch (CPU ranks: up to 20x a gather's median); releases took 5 us.
  Fixture f;
  schemas::Trace t = withHostTimes(0.2, 1.0, 50.0, 300.0);
  for (schemas::OpEvent& e : t.steps[0].graphs[0].events) {
    if (e.op == "allgather_param" && e.dsIds[0] == 1) e.issueUs = 2000.0;
    if (e.op == "release_param") e.issueUs = 5.0;
  }
  for (schemas::OpEvent& e : t.steps[0].graphs[1].events) {
    if (e.op == "release_param") e.issueUs = 5.0;
  }
  const SimResult recorded = simulateTrace(t, f.onUse());
  // Every gather of the recorded run launched (ZeRO-3 gathers again in the backward): a gather
  // that launches nothing costs what a release costs; a reduce_grad, what its quiet ones cost.
  EXPECT_EQ(recorded.quietIssueUs(schemas::OpRole::Gather), 5.0);
  EXPECT_EQ(recorded.quietIssueUs(schemas::OpRole::ReduceGrad), 50.0);
  EXPECT_FALSE(recorded.quietIssueUs(schemas::OpRole::GatherWait));
  // One fused forward prefetch of both: gather 1 launches nothing, and costs 5 us, not 2000 - 40.
  Schedule fused = f.onUse();
  fused.graphs[0].prefetch = {{0, {0, 1}}};
  const SimResult r = simulateTrace(t, fused, againstRecorded(recorded));
  EXPECT_NEAR(r.launchDeltaUs, -(2000.0 - 5.0), 1e-9);
  EXPECT_NEAR(r.prediction.stepUs, recorded.prediction.stepUs - (2000.0 - 5.0), 1e-9);
  // An op that still launches keeps its recorded time, outliers and all.
  Schedule again = f.onUse();
  EXPECT_NEAR(simulateTrace(t, again, againstRecorded(recorded)).prediction.stepUs,
              recorded.prediction.stepUs, 1e-9);
  // The launch charge alone spares less where it is the smaller saving: quiet ops dearer than
  // the op less its launch (a release of 1990 us) leave the charge as it was.
  for (schemas::TraceGraph& g : t.steps[0].graphs) {
    for (schemas::OpEvent& e : g.events) {
      if (e.op == "release_param") e.issueUs = 1990.0;
    }
  }
  const SimResult slowReleases = simulateTrace(t, f.onUse());
  EXPECT_NEAR(simulateTrace(t, fused, againstRecorded(slowReleases)).launchDeltaUs, -kDefaultLaunchUs, 1e-9);
}

TEST(SimulatorHostLane, TheHostsWaitForTheDeviceAfterTheBackwardIsNotHostWork) {
  // Device-bound, and the script synchronises after the optimizer: the recorded host time after
  // the backward holds the wait for the device (the backward's tail) and 30 us of its own.
  Fixture f;
  schemas::Trace t = withHostTimes(1.0, 0.2, 1.0, 0.0);
  schemas::Trace deviceOnly = t;
  deviceOnly.steps[0].optimizerHostUs.reset();
  const SimResult d = simulateTrace(deviceOnly, f.onUse());
  SimResult probe = simulateTrace(t, f.onUse());
  const double wait = probe.optimizerWaitUs;
  ASSERT_GT(wait, 2000);  // 600 us of host compute against 3,000 us of device compute
  t.steps[0].optimizerHostUs = wait + 30;
  const SimResult recorded = simulateTrace(t, f.onUse());
  EXPECT_NEAR(recorded.prediction.stepUs, d.prediction.stepUs, 1e-9);  // the device's 50 us ends it
  EXPECT_NEAR(recorded.hostUs, d.prediction.stepUs - 50 + 30, 1e-9);
  // A plan that hides the gathers ends with the device, not at the recorded host's end.
  Schedule s = f.onUse();
  s.graphs[0].prefetch = {{0, {0}}, {0, {1}}};  // the second gather of each graph hidden
  s.graphs[1].prefetch = {{0, {1}}, {0, {0}}};
  SimOptions o;
  o.referenceCalls = recorded.calls();
  o.reference = &recorded;
  const double faster = simulateTrace(deviceOnly, s).prediction.stepUs;
  ASSERT_LT(faster, d.prediction.stepUs - 100);
  EXPECT_NEAR(simulateTrace(t, s, o).prediction.stepUs, faster, 1e-9);
  // Without the reference the recorded wait would hold it at the recorded step.
  EXPECT_NEAR(simulateTrace(t, s).prediction.stepUs, recorded.prediction.stepUs - 50 + 30 + 0, 1e-6);
}

TEST(SimulatorHostLane, TheLaunchCostIsMeasuredFromTheTracesGathersAndReleases) {
  schemas::Trace t = withHostTimes(1.0, 1.0, 5.0, 10.0);
  EXPECT_EQ(measuredLaunchUs(makeWorkload(t)), 0.0);  // gathers cost what releases cost
  for (schemas::OpEvent& e : t.steps[0].graphs[0].events) {
    if (e.op == "allgather_param") e.issueUs = e.dsIds[0] == 0 ? 50.0 : 70.0;
  }
  for (schemas::OpEvent& e : t.steps[0].graphs[1].events) {
    if (e.op == "allgather_param") e.issueUs = 60.0;
  }
  // Medians: gathers 60 (50, 60, 60, 70), releases 5.
  const Workload w = makeWorkload(t);
  EXPECT_EQ(measuredLaunchUs(w), 55.0);
  const CostModelOptions o = costOptions(w, std::nullopt);
  EXPECT_TRUE(o.launchMeasured);
  EXPECT_EQ(CostModel(t.calibration, 2, o).launchUs(), 55.0);
  // On one rank too: the runtime still copies and casts for each gather call.
  t.meta.worldSize = 1;
  EXPECT_EQ(CostModel(t.calibration, 1, costOptions(makeWorkload(t), std::nullopt)).launchUs(), 55.0);
  EXPECT_EQ(CostModel(t.calibration, 1).launchUs(), 0.0);  // the default is a collective's
  // Without host times there is nothing to measure.
  t.steps[0].optimizerHostUs.reset();
  EXPECT_FALSE(measuredLaunchUs(makeWorkload(t)));
  EXPECT_FALSE(costOptions(makeWorkload(t), std::nullopt).launchMeasured);
}

TEST(SimulatorHostLane, OnGlooAWaitBlocksTheHostAndItsRecordedStallIsNotCountedTwice) {
  // CPU ranks: the host is the compute (host_us = compute_us) and a wait blocks it; the wait's
  // recorded time (100 us, its stall) is what the simulation makes again, not host work.
  Fixture f;
  schemas::Trace t = withHostTimes(1.0, 1.0, 0.0, 50.0, 100.0);
  t.meta.backend = "gloo";
  schemas::Trace deviceOnly = t;
  deviceOnly.steps[0].optimizerHostUs.reset();
  SimResult lane = simulateTrace(t, f.onUse());
  EXPECT_NEAR(lane.prediction.stepUs, simulateTrace(deviceOnly, f.onUse()).prediction.stepUs, 1e-9);
  EXPECT_NEAR(lane.hostUs, lane.prediction.stepUs, 1e-9);  // the host waited for every gather
  // On NCCL the same 100 us are the host's own work at each of the 4 waits, and it never blocks.
  t.meta.backend = "nccl";
  EXPECT_NEAR(simulateTrace(t, f.onUse()).hostUs, 3000 + 4 * 100.0 + 50, 1e-9);
}

TEST(Simulator, PrefetchHidesTheSecondGather) {
  Fixture f;
  Schedule s = f.onUse();
  s.graphs[0].prefetch = {{0, {0}}, {0, {1}}};  // two calls at graph start
  SimResult r = f.run(s);
  SimResult base = f.run(f.onUse());
  EXPECT_NEAR(base.prediction.stepUs - r.prediction.stepUs, kTinyGatherUs, 1e-6);
  EXPECT_EQ(r.gatherCalls, 4);
  // Both parameters are gathered together in the forward now.
  EXPECT_EQ(r.prediction.peakMemoryBytes, base.prediction.peakMemoryBytes);
}

TEST(Simulator, FusedGroupIsOneCallThatEndsTogether) {
  Fixture f;
  Schedule s = f.onUse();
  s.graphs[0].prefetch = {{0, {0, 1}}};
  SimResult r = f.run(s, true);
  EXPECT_EQ(r.gatherCalls, 3);
  ASSERT_FALSE(r.gathers.empty());
  EXPECT_NEAR(r.gathers[0].endUs, f.cost.us(Collective::AllGather, 2 * kTinyParam), 1e-9);
  EXPECT_EQ(r.gathers[0].params.size(), 2u);
}

TEST(Simulator, BucketReducesWhenItsLastGradientIsReady) {
  Fixture f;
  SimResult one = f.run(f.onUse({{1, 0}}));
  SimResult two = f.run(f.onUse({{1}, {0}}));
  // Two buckets: the first overlaps the second half of backward; the tail is one small reduce.
  EXPECT_NEAR(two.prediction.stepUs, 4 * kTinyGatherUs + 3000 + kTinyGatherUs + 50, 1e-6);
  EXPECT_LT(two.prediction.stepUs, one.prediction.stepUs);
  EXPECT_EQ(two.reduceCalls, 2);
  // The first bucket's packed input and output live until the second launches (the runtime
  // frees them there): at that launch, gathered 0, the first bucket, the second's input and
  // output, and gradient 0, which reduce_grad's caller holds until it returns.
  EXPECT_EQ(two.prediction.peakMemoryBytes,
            kTinyBase + kTinyParam + (kTinyParam + kTinyShard) + (kTinyParam + kTinyShard) + kTinyParam);
}

/// The tiny trace recorded on one rank: each shard is its whole parameter.
schemas::Trace oneRankTinyTrace() {
  schemas::Trace t = test::tinyTrace();
  t.meta.worldSize = 1;
  for (schemas::TraceParam& p : t.params) p.shardNumel = p.numel;
  return t;
}

TEST(Simulator, OneRankReducesABucketByPackingIt) {
  // At one rank the packed bucket is its own reduction's output (RuntimeMemory::packsIntoOutput):
  // no input beside the output slices, no reduce-scatter. At the second bucket's launch: gathered
  // 0, the first bucket's output (parameter 1's gradient), the second's, and gradient 0, which
  // reduce_grad's caller holds until it returns; two ranks hold each bucket's input beside.
  const schemas::Trace t = oneRankTinyTrace();
  const Workload w = makeWorkload(t);
  const CostModel cost{t.calibration, 1};
  Fixture f;
  const Schedule s = f.onUse({{1}, {0}});
  const SimResult one = simulate(w, cost, compileSchedule(w, s), SimOptions{});
  EXPECT_EQ(one.prediction.peakMemoryBytes, kTinyBase + 4 * kTinyParam);
  EXPECT_EQ(one.reduceBusyUs, 0);
  // The gathers are still copies on one rank (the trace calibrated them there); no reduction
  // tail after the last compute, as two ranks have (BucketReducesWhenItsLastGradientIsReady).
  EXPECT_NEAR(one.prediction.stepUs, 4 * kTinyGatherUs + 3000 + 50, 1e-6);
}

TEST(Simulator, AOneRankRecordingsBucketHoldsNoInputBesideItsOutput) {
  // As TheRecordedRunsOwnBucketInputIsNotActivation, recorded on one rank: the first bucket,
  // flushed at the second gradient's reduce_grad, is packed into its output, which becomes the
  // shard's gradient; nothing else of it is held. Only the 12,345 bytes are activations.
  schemas::Trace t = oneRankTinyTrace();
  auto& bwd = t.steps[0].graphs[1].events;
  bwd[2].bytes = bwd[6].bytes = 60'000'000;
  const uint64_t shardGrad = RuntimeMemory::of(t.meta, 1).param(t.params[1].numel).output;
  for (size_t i = 7; i < bwd.size(); ++i) bwd[i].memoryBytes += shardGrad - kTinyParam + 12'345;
  Workload w = makeWorkload(t);
  EXPECT_EQ(w.runs[1].activationBytes[6], 0u);
  EXPECT_EQ(w.runs[1].activationBytes[7], 12'345u);
  EXPECT_EQ(w.runs[1].activationBytes[8], 12'345u);
}

TEST(Simulator, PersistentParameterIsGatheredOncePerStepAndCountsAllStep) {
  Fixture f;
  Schedule s = f.onUse();
  s.persistent = {0};
  SimResult r = f.run(s);
  EXPECT_EQ(r.gatherCalls, 3);
  SimResult base = f.run(f.onUse());
  EXPECT_NEAR(base.prediction.stepUs - r.prediction.stepUs, kTinyGatherUs, 1e-6);
  // In backward, at the bucket's launch: persistent 0, both gradients and the bucket they are
  // packed into (gathered 1 is released by then).
  EXPECT_EQ(r.prediction.peakMemoryBytes, kTinyBase + kTinyParam + 4 * kTinyParam);
}

TEST(Simulator, PersistentCopyEndsAtItsLastBackwardUseBeforeTheStep) {
  // Parameter 1 is the first used in backward: its copy ends at its release there (the
  // optimizer step makes it stale), before 0 is gathered.
  Fixture f;
  Schedule s = f.onUse();
  s.persistent = {1};
  EXPECT_EQ(f.run(s).prediction.peakMemoryBytes, kTinyBase + kTinyParam + 4 * kTinyParam);
  // With two micro-steps the first backward keeps it: at its launch it meets gathered 0 and the
  // bucket too.
  schemas::Trace t = test::tinyTrace();
  t.meta.gradAccumSteps = 2;
  Workload w = makeWorkload(t);
  SimResult acc = simulate(w, f.cost, compileSchedule(w, s), SimOptions{});
  EXPECT_EQ(acc.prediction.peakMemoryBytes, kTinyBase + 2 * kTinyParam + 4 * kTinyParam);
}

TEST(Simulator, APlanNamesWherePersistentCopiesEndAsTheModelEndsThem) {
  // The runtime drops a persistent copy where the plan says (persistent_ends): each trainable
  // persistent parameter's last release in the backward graph, the op the model drops it at.
  const schemas::Trace t = test::tinyTrace();
  const schemas::Plan plan = makePlan(t, PlanRequest{}).plan;
  ASSERT_FALSE(plan.persistent.empty()) << "an unconstrained plan of the tiny trace keeps copies";
  const Workload w = makeWorkload(t);
  for (size_t g = 0; g < w.graphs.size(); ++g) {
    std::vector<schemas::PersistentEnd> want;
    for (size_t i = 0; i < w.graphs[g].ops.size(); ++i) {
      const WorkOp& op = w.graphs[g].ops[i];
      const bool persistent = op.param >= 0 && std::count(plan.persistent.begin(), plan.persistent.end(),
                                                          w.params[static_cast<size_t>(op.param)].id);
      if (persistent && endsPersistentCopy(w, w.graphs[g], op)) {
        want.push_back({static_cast<int64_t>(i), w.params[static_cast<size_t>(op.param)].id});
      }
    }
    EXPECT_EQ(plan.graphs[g].persistentEnds, want) << "graph " << g;
    if (w.graphs[g].kind == schemas::GraphKind::Backward) EXPECT_EQ(want.size(), plan.persistent.size());
  }
  schemas::Plan back;
  ASSERT_TRUE(schemas::validatePlan(schemas::parseJson(schemas::writePlan(plan), "p"), back).empty());
  for (size_t g = 0; g < plan.graphs.size(); ++g) EXPECT_EQ(back.graphs[g].persistentEnds, plan.graphs[g].persistentEnds);
  // In a forward graph the list is refused, naming it.
  nlohmann::json doc = schemas::parseJson(schemas::writePlan(plan), "p");
  doc["graphs"][0]["persistent_ends"] = nlohmann::json::array({{{"position", 0}, {"ds_id", 0}}});
  const auto diags = schemas::validatePlan(doc, back);
  ASSERT_FALSE(diags.empty());
  EXPECT_EQ(diags.front().pointer, "/graphs/0/persistent_ends");
}

TEST(Simulator, ThePlansPersistentEndsAreWhereTheSimulationDropsTheCopies) {
  // The simulation drops a persistent copy where the plan names it, as the runtime does; a
  // schedule naming none at all falls back to endsPersistentCopy (plans made before the field).
  Fixture f;
  Schedule s = f.onUse();
  s.persistent = {0, 1};
  const uint64_t byRule = f.run(s).prediction.peakMemoryBytes;
  s.graphs[1].persistentEnds = {{3, 1}, {7, 0}};  // what the rule names: the same
  EXPECT_EQ(f.run(s).prediction.peakMemoryBytes, byRule);
  // Named only for 0: parameter 1's copy lives to the backward's end, through the bucket's launch.
  s.graphs[1].persistentEnds = {{7, 0}};
  EXPECT_EQ(f.run(s).prediction.peakMemoryBytes, byRule + kTinyParam);
  // A position that is not a release of the id named is refused, naming the entry.
  s.graphs[1].persistentEnds = {{7, 1}};
  try {
    f.run(s);
    FAIL() << "an end at another parameter's release was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "/graphs/1/persistent_ends/0: expected the position of a release_param of ds_id 1 in graph 1 of "
              "the trace");
  }
  s.graphs[1].persistentEnds = {{9, 0}};  // past the graph's last op
  EXPECT_THROW(f.run(s), std::invalid_argument);
  // A frozen parameter's copy outlives the step (the runtime keeps it): naming its end is refused.
  Workload frozen = f.w;
  frozen.params[static_cast<size_t>(frozen.paramIndex(0))].requiresGrad = false;
  s.graphs[1].persistentEnds = {{7, 0}};
  EXPECT_THROW(compileSchedule(frozen, s), std::invalid_argument);
}

TEST(Simulator, TimelineCoversStreamsAndOptimizer) {
  Fixture f;
  SimResult r = f.run(f.onUse(), true);
  int compute = 0, gathers = 0, reduces = 0, optimizer = 0;
  for (const TimelineEvent& e : r.timeline) {
    EXPECT_LE(e.startUs, e.endUs);
    EXPECT_LE(e.endUs, r.prediction.stepUs + 1e-9);
    if (e.stream == Stream::Compute && e.name == "optimizer")
      ++optimizer;
    else if (e.stream == Stream::Compute)
      ++compute;
    if (e.stream == Stream::AllGather) ++gathers;
    if (e.stream == Stream::Reduce) ++reduces;
  }
  EXPECT_EQ(compute, 4);
  EXPECT_EQ(gathers, 4);
  EXPECT_EQ(reduces, 1);
  EXPECT_EQ(optimizer, 1);
  EXPECT_FALSE(r.memory.empty());
}

TEST(Simulator, ScheduleThatDoesNotFitTheTraceIsRejectedWithAPointer) {
  Fixture f;
  auto expectError = [&](const Schedule& s, const std::string& start) {
    try {
      compileSchedule(f.w, s);
      ADD_FAILURE() << "accepted, expected " << start;
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind(start, 0), 0u) << e.what();
    }
  };
  expectError(f.onUse({{1}}), "/graphs/1/buckets: ds_id 0 is reduced in graph 1 but is in no bucket");
  Schedule s = f.onUse();
  s.graphs[0].prefetch = {{0, {7}}};
  expectError(s, "/graphs/0/prefetch/0/ds_ids/0: ds_id 7 is not a parameter");
  s.graphs[0].prefetch = {{99, {1}}};
  expectError(s, "/graphs/0/prefetch/0/position: 99 is not a position of graph 0");
  s = f.onUse();
  s.persistent = {5};
  expectError(s, "/persistent/0: ds_id 5");
  s = f.onUse();
  s.graphs[1].id = 9;
  expectError(s, "/graphs/1/id: graph 9 is not in the trace");
  s = f.onUse({{1, 0}, {0}});
  expectError(s, "/graphs/1/buckets/1/ds_ids/0: ds_id 0 is in two buckets");
}

TEST(Simulator, ActivationMemoryIsRecordedMemoryLessRecordedGathers) {
  schemas::Trace t = test::tinyTrace();
  // 5,000 bytes of activations appear after the first forward module.
  for (size_t i = 3; i < t.steps[0].graphs[0].events.size(); ++i)
    t.steps[0].graphs[0].events[i].memoryBytes += 5'000;
  Workload w = makeWorkload(t);
  EXPECT_EQ(w.runs[0].activationBytes[0], 0u);
  EXPECT_EQ(w.runs[0].activationBytes[1], 0u);
  EXPECT_EQ(w.runs[0].activationBytes[3], 5'000u);
  EXPECT_EQ(w.runs[0].activationBytes[4], 5'000u);
}

TEST(Simulator, APeakBetweenTwoOpsCountsWithWhatWasHeldThen) {
  // 400,000 bytes of temporaries in the forward compute before parameter 0's release: its
  // gathered copy (100,000 bytes) is still held then.
  schemas::Trace t = test::tinyTrace();
  schemas::OpEvent& release = t.steps[0].graphs[0].events[2];
  ASSERT_EQ(release.op, "release_param");
  release.peakBytes = release.memoryBytes + 600'000;
  Workload w = makeWorkload(t);
  EXPECT_EQ(w.runs[0].activationBytes[2], 0u);
  EXPECT_EQ(w.runs[0].computePeakBytes[2], 600'000u);
  EXPECT_EQ(w.runs[0].computePeakBytes[1], w.runs[0].activationBytes[1]);  // no peak recorded: at the op
  Fixture f;
  SimResult r = simulate(w, f.cost, compileSchedule(w, f.onUse()), SimOptions{});
  EXPECT_EQ(r.prediction.peakMemoryBytes, kTinyBase + kTinyParam + 600'000);
}

TEST(Simulator, AGlooFusedCallHoldsItsBufferUntilItsFirstWait) {
  // Gloo: a single gather holds nothing but its copy; a call gathering both parameters at the
  // forward's start holds its [world, total] buffer (the call's bytes) until the first wait on a
  // member, which copies it out: before parameter 1's wait only that copy is held (0's released).
  schemas::Trace t = test::tinyTrace();
  t.meta.backend = "gloo";
  t.meta.device = "cpu";
  const Workload w = makeWorkload(t);
  EXPECT_EQ(w.runs[0].activationBytes[4], 0u);
  Fixture f;
  const CostModel cost{t.calibration, 2};
  uint64_t forwardPeak = 0;
  for (const MemorySample& m : simulate(w, cost, compileSchedule(w, f.onUse()), SimOptions{true}).memory)
    if (m.run == 0) forwardPeak = std::max(forwardPeak, m.bytes);
  EXPECT_EQ(forwardPeak, kTinyBase + kTinyParam);
  Schedule s = f.onUse();
  s.graphs[0].prefetch = {{0, {0, 1}}};
  const SimResult r = simulate(w, cost, compileSchedule(w, s), SimOptions{true});
  uint64_t atIssue = 0, beforeSecondWait = 0;
  for (const MemorySample& m : r.memory) {
    if (m.run != 0) continue;
    if (m.seq == 0 && m.atOp) atIssue = m.bytes;
    if (m.seq == 4 && !m.atOp) beforeSecondWait = m.bytes;
  }
  EXPECT_EQ(atIssue, kTinyBase + 2 * kTinyParam + 2 * kTinyParam);
  EXPECT_EQ(beforeSecondWait, kTinyBase + kTinyParam);
}

TEST(Simulator, TheRecordedRunsFusedCallBufferIsNotActivation) {
  // Gloo: the recorded run prefetched both parameters in one call before its first gather (as its
  // module hooks do for a module of several parameters); the call's [world, total] buffer (its
  // bytes) was in the memory until the wait on parameter 0. Neither it nor the copies is activation.
  schemas::Trace t = test::tinyTrace();
  t.meta.backend = "gloo";
  t.meta.device = "cpu";
  auto& fwd = t.steps[0].graphs[0].events;
  schemas::OpEvent prefetch = fwd[0];
  prefetch.op = "prefetch_params_fused";
  prefetch.dsIds = {0, 1};
  prefetch.bytes = 2 * kTinyParam;
  fwd.insert(fwd.begin(), prefetch);
  for (size_t i = 0; i < fwd.size(); ++i) fwd[i].seq = static_cast<int64_t>(i);
  const uint64_t both = 2 * kTinyParam;
  fwd[1].bytes = 0;  // parameter 0's gather: in flight already, no call
  fwd[1].memoryBytes = kTinyBase + both + both;
  fwd[2].memoryBytes = kTinyBase + both + both;  // its wait: the buffer freed here
  fwd[3].memoryBytes = kTinyBase + both;         // release 0
  fwd[4].bytes = 0;                              // parameter 1's gather: held already
  const Workload w = makeWorkload(t);
  for (size_t i = 0; i < fwd.size(); ++i) EXPECT_EQ(w.runs[0].activationBytes[i], 0u) << fwd[i].op;
}

TEST(Simulator, TheRecordedRunsOwnBucketInputIsNotActivation) {
  // Two 60 MB gradients (reduce bytes): the recorded run (default 100 MB buckets) flushes the
  // first bucket at the second gradient's reduce_grad: its gradient is freed, its packed input
  // held until end_backward, and its output slice (fp32) becomes the shard's gradient. That is
  // in the recorded memory, with 12,345 bytes of activations; only those are activations.
  schemas::Trace t = test::tinyTrace();
  auto& bwd = t.steps[0].graphs[1].events;
  bwd[2].bytes = bwd[6].bytes = 60'000'000;
  const RuntimeMemory nccl = RuntimeMemory::of(t.meta, 2);
  const uint64_t shardGrad = nccl.param(t.params[1].numel).output;
  const uint64_t input = nccl.allocation(60'000'000);  // in 512-byte blocks
  for (size_t i = 7; i < bwd.size(); ++i) bwd[i].memoryBytes += input + shardGrad - kTinyParam + 12'345;
  Workload w = makeWorkload(t);
  const GraphRun& run = w.runs[1];
  EXPECT_EQ(run.activationBytes[6], 0u);
  EXPECT_EQ(run.activationBytes[7], 12'345u);
  EXPECT_EQ(run.activationBytes[8], 12'345u);
}

TEST(Simulator, TheRecordedRunsZero1FlatBuffersAreNotActivation) {
  // ZeRO-1 without a plan copies gradients into flat buffers of the configured 100 MB, allocated
  // at the first gradient of each of its two buffers and kept until end_backward; every
  // gathered copy is kept too; the first bucket's reduction makes its parameter's fp32 shard
  // gradient. The recorded memory holds them and 12,345 bytes of activations.
  schemas::Trace t = test::tinyTrace();
  t.meta.stage = 1;
  auto& bwd = t.steps[0].graphs[1].events;
  bwd[2].bytes = bwd[6].bytes = 60'000'000;  // the second flushes the first and fills the other buffer
  const RuntimeMemory nccl = RuntimeMemory::of(t.meta, 2);
  const uint64_t shardGrad = nccl.param(t.params[1].numel).shardGrad;
  const uint64_t buffer = nccl.allocation(100'000'000);  // the configured 100 MB, in 512-byte blocks
  for (size_t i = 3; i < bwd.size(); ++i) bwd[i].memoryBytes += buffer + 12'345;
  for (size_t i = 7; i < bwd.size(); ++i) bwd[i].memoryBytes += buffer + shardGrad;
  // The recorded gradients are copied into the buffer, not held: take them out of the trace.
  for (size_t i = 3; i < bwd.size(); ++i) bwd[i].memoryBytes -= kTinyParam;
  for (size_t i = 7; i < bwd.size(); ++i) bwd[i].memoryBytes -= kTinyParam;
  // ZeRO-1 keeps both gathered copies from the forward on (the tiny trace has one at most).
  for (size_t i = 0; i < bwd.size(); ++i) {
    const bool oneGathered = (i >= 1 && i <= 3) || (i >= 5 && i <= 7);
    bwd[i].memoryBytes += oneGathered ? kTinyParam : 2 * kTinyParam;
  }
  Workload w = makeWorkload(t);
  // At reduce_grad 0 (op 6) the gradient handed over is still autograd's: ZeRO-1 copies it into
  // the bucket during the op, so at its issue it is activation memory.
  for (size_t i = 3; i < 8; ++i)
    EXPECT_EQ(w.runs[1].activationBytes[i], 12'345u + (i == 6 ? kTinyParam : 0)) << i;
}

TEST(Simulator, GraphRunsMustRepeatTheSameOps) {
  schemas::Trace t = test::tinyTrace();
  schemas::TraceGraph again = t.steps[0].graphs[0];
  again.events.pop_back();
  t.steps[0].graphs.push_back(again);
  EXPECT_THROW(makeWorkload(t), std::invalid_argument);
}

TEST(Simulator, AnOpsHostTimeIsWhenTheHostEntersIt) {
  // With a host lane: the host issues each stretch of compute in its host_us and each op in its
  // issue_us (10 us here); NCCL's waits do not hold the host. So the host enters op i at the sum
  // of host_us up to it and issue_us before it, across the forward and the backward.
  schemas::Trace t = test::tinyTrace();
  for (schemas::TraceGraph& g : t.steps[0].graphs) {
    for (schemas::OpEvent& e : g.events) {
      e.hostUs = e.computeUs;
      e.issueUs = 10.0;
    }
  }
  t.steps[0].optimizerHostUs = 50;
  Workload w = makeWorkload(t);
  ASSERT_TRUE(w.hostLane);
  CostModel cost{t.calibration, 2};
  SimResult r = simulate(w, cost, compileSchedule(w, defaultSchedule(w)), SimOptions{true});
  std::map<std::pair<int32_t, int64_t>, double> entered;
  for (const MemorySample& m : r.memory) {
    if (!m.atOp && m.seq >= 0) entered[{m.run, m.seq}] = m.hostUs;
  }
  EXPECT_NEAR((entered[{0, 0}]), 0, 1e-9);
  EXPECT_NEAR((entered[{0, 2}]), 500 + 2 * 10, 1e-9);    // after the forward's first compute
  EXPECT_NEAR((entered[{0, 5}]), 1000 + 5 * 10, 1e-9);   // the forward's last op
  EXPECT_NEAR((entered[{1, 0}]), 1000 + 6 * 10, 1e-9);   // the backward's first, after 6 ops
  EXPECT_NEAR((entered[{1, 8}]), 3000 + 14 * 10, 1e-9);  // end_backward
  // Without host times the device's clock stands in.
  Fixture f;
  ASSERT_FALSE(f.w.hostLane);
  for (const MemorySample& m : f.run(f.onUse(), true).memory) EXPECT_EQ(m.hostUs, m.us);
}

TEST(Simulator, DefaultScheduleIsGatherOnUseWithOneBucketSize) {
  Fixture f;
  Schedule d = defaultSchedule(f.w);
  EXPECT_TRUE(d.persistent.empty());
  ASSERT_EQ(d.graphs.size(), 2u);
  EXPECT_TRUE(d.graphs[0].prefetch.empty());
  ASSERT_EQ(d.graphs[1].buckets.size(), 1u);
  EXPECT_EQ(d.graphs[1].buckets[0].dsIds, (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(d.graphs[1].buckets[0].bytes, 2 * kTinyParam);
}

}  // namespace
}  // namespace dcplan::planner

namespace dcplan::planner {
namespace {

TEST(Workload, AnOptimizerStepIsGradAccumMicroSteps) {
  testing::GeneratorOptions o;
  o.model.layers = 1;
  o.model.hidden = 256;
  o.model.heads = 2;
  o.model.vocab = 1000;
  o.gradAccumSteps = 4;
  o.steps = 2;  // 8 recorded micro-steps
  schemas::Trace t = testing::generateTrace(o);
  Workload w = makeWorkload(t);
  ASSERT_EQ(w.runs.size(), 8u);
  for (size_t r = 0; r < w.runs.size(); ++r) EXPECT_EQ(w.runs[r].microStep, static_cast<int32_t>(r / 2));
  EXPECT_EQ(w.traceStep, 7);
  EXPECT_GT(w.optimizerUs, 0);
  // Gathered on use, every parameter is gathered in each forward and backward.
  for (int32_t n : gathersPerStep(w)) EXPECT_EQ(n, 8);

  // One recorded micro-step of a 4-step accumulation stands in for the others.
  t.steps.erase(t.steps.begin(), t.steps.end() - 1);
  Workload one = makeWorkload(t);
  EXPECT_EQ(one.runs.size(), 8u);
  EXPECT_EQ(one.runs.back().microStep, 3);
}

}  // namespace
}  // namespace dcplan::planner

namespace dcplan::planner {
namespace {

/// A generated trace of `hostScale.size()` recorded micro-steps (`gradAccum` per optimizer step)
/// with host times: every op's host_us is its compute and issue_us 10 us, the optimizer's host
/// time its device time, all times hostScale[micro-step].
schemas::Trace traceWithHostTimes(const std::vector<double>& hostScale, int64_t gradAccum = 1) {
  testing::GeneratorOptions o;
  o.model.layers = 1;
  o.model.hidden = 256;
  o.model.heads = 2;
  o.model.vocab = 1000;
  o.gradAccumSteps = gradAccum;
  o.steps = static_cast<int64_t>(hostScale.size()) / gradAccum;
  o.jitter = 0;  // the steps differ by hostScale alone
  schemas::Trace t = testing::generateTrace(o);
  for (size_t s = 0; s < t.steps.size(); ++s) {
    for (schemas::TraceGraph& g : t.steps[s].graphs) {
      for (schemas::OpEvent& e : g.events) {
        e.hostUs = e.computeUs * hostScale[s];
        e.issueUs = 10 * hostScale[s];
      }
    }
    t.steps[s].optimizerHostUs = t.steps[s].optimizerUs * hostScale[s];
  }
  return t;
}

TEST(Workload, AWorldSizeWhatIfScalesTheOptimizerWithItsShards) {
  // The tiny trace's 50 us optimizer steps the shards of 2 ranks: a quarter of them at 8 ranks.
  schemas::Trace t = test::tinyTrace();
  EXPECT_DOUBLE_EQ(makeWorkload(t).optimizerUs, 50.0);
  EXPECT_DOUBLE_EQ(makeWorkload(t, 8).optimizerUs, 12.5);
  EXPECT_DOUBLE_EQ(makeWorkload(t, 1).optimizerUs, 100.0);
  // With host times: on a GPU the host issues the optimizer per tensor (kept); on CPU ranks the
  // host runs it (scaled as the device's work).
  t.steps[0].optimizerHostUs = 40.0;
  for (auto& g : t.steps[0].graphs) {
    for (auto& e : g.events) {
      e.hostUs = e.computeUs;
      e.issueUs = 0.0;
    }
  }
  ASSERT_TRUE(makeWorkload(t, 8).hostLane);
  EXPECT_DOUBLE_EQ(makeWorkload(t, 8).optimizerHostUs, 40.0);
  t.meta.backend = "gloo";
  t.meta.device = "cpu";
  EXPECT_DOUBLE_EQ(makeWorkload(t, 8).optimizerHostUs, 10.0);
  EXPECT_DOUBLE_EQ(makeWorkload(t).optimizerHostUs, 40.0);
}

TEST(Workload, AWorldSizeWhatIfScalesWhatTheOptimizerHoldsWithItsShards) {
  // The recorded optimizer step held 80,000 bytes above the first op's memory (ZeRO-3: gradient
  // shards, temporaries, per shard): 20,000 at 8 ranks, 160,000 at 1; the first op's own memory
  // is kept.
  schemas::Trace t = test::tinyTrace();
  schemas::OpEvent& first = t.steps[0].graphs[0].events[0];
  first.peakBytes = first.memoryBytes + 80'000;
  auto optimizerHolds = [](const Workload& w) {
    return w.runs.front().computePeakBytes.front() - w.runs.front().activationBytes.front();
  };
  const Workload recorded = makeWorkload(t);
  EXPECT_EQ(optimizerHolds(recorded), 80'000u);
  EXPECT_EQ(recorded.leastOptimizerExcessBytes, 80'000u);
  const Workload eight = makeWorkload(t, 8);
  EXPECT_EQ(optimizerHolds(eight), 20'000u);
  EXPECT_EQ(eight.leastOptimizerExcessBytes, 20'000u);
  EXPECT_EQ(eight.runs.front().activationBytes.front(), recorded.runs.front().activationBytes.front());
  EXPECT_EQ(optimizerHolds(makeWorkload(t, 1)), 160'000u);
  // The rest of the step is the model's: not scaled.
  EXPECT_EQ(eight.runs.back().computePeakBytes, recorded.runs.back().computePeakBytes);
  // ZeRO-1/2 hold every gathered copy there (and ZeRO-1 full gradients), which do not shrink: kept.
  for (int64_t stage : {1, 2}) {
    t.meta.stage = stage;
    EXPECT_EQ(optimizerHolds(makeWorkload(t, 8)), optimizerHolds(makeWorkload(t))) << "ZeRO-" << stage;
  }
}

TEST(Workload, StepsThatAgreeArePlannedFromTheLast) {
  Workload w = makeWorkload(traceWithHostTimes({1.0, 1.09, 1.0}));
  EXPECT_EQ(w.traceStep, 2);
  EXPECT_TRUE(w.hostLane);
  EXPECT_EQ(w.stepChoice, "");
}

TEST(Workload, StepsThatDisagreeArePlannedFromTheMedianAndSaySo) {
  // The last of three steps took twice the host time: the median is step 1.
  Workload three = makeWorkload(traceWithHostTimes({1.0, 1.05, 2.0}));
  EXPECT_EQ(three.traceStep, 1);
  EXPECT_NE(three.stepChoice.find("disagree on host time by more than 10%"), std::string::npos)
      << three.stepChoice;
  EXPECT_NE(three.stepChoice.find("planned from step 1, the median, not the last"), std::string::npos)
      << three.stepChoice;
  // A machine warming up: each step faster than the one before; the median is the middle one.
  Workload warming = makeWorkload(traceWithHostTimes({1.8, 1.2, 1.0}));
  EXPECT_EQ(warming.traceStep, 1);
  // Of an even count, the faster of the two middle steps.
  EXPECT_EQ(makeWorkload(traceWithHostTimes({1.0, 1.6, 1.3, 2.0})).traceStep, 2);
  // The last is the median: planned from it, and the plan still says the steps disagree.
  Workload last = makeWorkload(traceWithHostTimes({2.0, 1.0, 1.5}));
  EXPECT_EQ(last.traceStep, 2);
  EXPECT_NE(last.stepChoice.find("planned from step 2, the median;"), std::string::npos) << last.stepChoice;
  // The plan carries the choice as a warning (dcplan plan prints it).
  PlanRequest req;
  req.strategy = Strategy::Default;
  PlanResult r = makePlan(traceWithHostTimes({1.0, 1.05, 2.0}), req);
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_EQ(r.warnings[0], three.stepChoice);
}

TEST(Workload, AStepRecordedPartWayIsLeftOutOfTheChoice) {
  // 2 micro-steps per optimizer step, the first recorded part-way (its first micro-step dropped):
  // with half the host time it would be the fastest; it is left out, and the complete ones agree.
  schemas::Trace t = traceWithHostTimes({1.0, 1.0, 1.0, 1.0, 1.05, 1.05}, 2);
  t.steps.erase(t.steps.begin());
  Workload w = makeWorkload(t);
  EXPECT_EQ(w.traceStep, 5);
  EXPECT_EQ(w.stepChoice, "");
}

TEST(Workload, StepsWithoutHostTimesArePlannedFromTheLast) {
  schemas::Trace t = traceWithHostTimes({1.0, 3.0});
  t.steps[0].graphs[0].events[0].issueUs.reset();
  Workload w = makeWorkload(t);
  EXPECT_EQ(w.traceStep, 1);
  EXPECT_EQ(w.stepChoice, "");
}

}  // namespace
}  // namespace dcplan::planner
