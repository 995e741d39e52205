// Tests of the in-situ scale of collectives: on CPU ranks the recorded run, a measurement of the
// default schedule, sets how long its collectives take.
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "dcplan/planner/in_situ.h"
#include "dcplan/planner/planner.h"
#include "dcplan/planner/report.h"
#include "dcplan/planner/simulator.h"
#include "dcplan/schemas/io.h"
#include "dcplan/schemas/units.h"
#include "tiny_trace.h"

namespace dcplan::planner {
namespace {

/// The tiny trace as 2 Gloo ranks record it: the host is the compute, each op issues in 5 us, and
/// each wait stood still `waitUs` (its gather as the job ran it), the optimizer 50 us.
schemas::Trace glooTrace(double waitUs) {
  schemas::Trace t = test::tinyTrace();
  t.meta.backend = "gloo";
  t.meta.device = "cpu";
  for (schemas::TraceStep& step : t.steps) {
    step.optimizerHostUs = 50.0;
    for (schemas::TraceGraph& g : step.graphs) {
      for (schemas::OpEvent& e : g.events) {
        e.hostUs = e.computeUs;
        e.issueUs = e.op == "wait_allgather" ? waitUs
                    : e.op == "end_backward" ? 3 * test::kTinyGatherUs
                                             : 5.0;
      }
    }
  }
  return t;
}

double defaultStepUs(const schemas::Trace& t, const Workload& w, const CostModel& cost) {
  return simulate(w, cost, compileSchedule(w, defaultSchedule(w))).prediction.stepUs;
}

TEST(InSitu, TheDefaultScheduleTakesTheRecordedStep) {
  const schemas::Trace t = glooTrace(4 * test::kTinyGatherUs);  // gathers 4x slower than calibrated
  const Workload w = makeWorkload(t);
  ASSERT_TRUE(w.hostLane && w.waitsBlockHost);
  std::optional<InSituFit> fit;
  const CostModel cost = plannedCostModel(t, w, std::nullopt, nullptr, std::nullopt, &fit);
  ASSERT_TRUE(fit);
  EXPECT_NEAR(fit->measuredUs, w.recordedHostUs, 1e-9);
  EXPECT_LT(fit->calibratedUs, fit->measuredUs);
  EXPECT_GT(fit->scale, 2.0);
  EXPECT_FALSE(fit->atBound);
  EXPECT_NEAR(cost.inSituScale(), fit->scale, 1e-12);
  // Bisected to 2^-24 of the log range: the step agrees to far better than 0.1%.
  EXPECT_NEAR(defaultStepUs(t, w, cost), fit->measuredUs, 1e-3 * fit->measuredUs);
  // The plan's own prediction of the default schedule is the recorded step, and the line says so.
  PlanRequest req;
  req.explain = true;
  const PlanResult r = makePlan(t, req);
  EXPECT_NEAR(r.plan.predictedDefault.stepUs, fit->measuredUs, 1e-3 * fit->measuredUs);
  ASSERT_TRUE(r.plan.options.inSituScale);  // carried, so that inspect simulates it alike
  EXPECT_NEAR(*r.plan.options.inSituScale, fit->scale, 1e-12);
  bool said = false;
  for (const std::string& line : r.explanation)
    said = said || line.find("collectives in situ") != std::string::npos;
  EXPECT_TRUE(said);
}

TEST(InSitu, AWorldSizeWhatIfKeepsTheScaleFittedWhereTheRunRan) {
  const schemas::Trace t = glooTrace(4 * test::kTinyGatherUs);
  const std::optional<InSituFit> traced = fitInSitu(t, makeWorkload(t), std::nullopt, nullptr);
  const std::optional<InSituFit> whatIf = fitInSitu(t, makeWorkload(t, 8), std::nullopt, nullptr);
  ASSERT_TRUE(traced && whatIf);
  EXPECT_DOUBLE_EQ(whatIf->scale, traced->scale);
  // ... so 8 ranks' longer rings are not scaled away: the default schedule is slower than recorded.
  const Workload eight = makeWorkload(t, 8);
  const CostModel cost = plannedCostModel(t, eight, std::nullopt);
  EXPECT_GT(simulate(eight, cost, compileSchedule(eight, defaultSchedule(eight))).prediction.stepUs,
            traced->measuredUs * 1.01);
}

TEST(InSitu, ARecordedRunFasterThanTheCalibrationScalesBelowOne) {
  const schemas::Trace t = glooTrace(0.0);  // every wait returned at once
  const Workload w = makeWorkload(t);
  const std::optional<InSituFit> fit = fitInSitu(t, w, std::nullopt, nullptr);
  ASSERT_TRUE(fit);
  EXPECT_LT(fit->scale, 1.0);
  EXPECT_GE(fit->scale, kInSituMin);
}

TEST(InSitu, ARecordedStepTheCollectivesCannotExplainStopsAtTheBound) {
  // Waits 50x the calibrated gather: more than the largest scale explains.
  const schemas::Trace t = glooTrace(50 * test::kTinyGatherUs);
  const Workload w = makeWorkload(t);
  const std::optional<InSituFit> fit = fitInSitu(t, w, std::nullopt, nullptr);
  ASSERT_TRUE(fit);
  EXPECT_TRUE(fit->atBound);
  EXPECT_DOUBLE_EQ(fit->scale, kInSituMax);
  EXPECT_NE(inSituText(*fit).find("not applied, planned with the calibration as measured"),
            std::string::npos);
  // Not applied: the calibration as measured, and the plan warns.
  EXPECT_EQ(plannedCostModel(t, w, std::nullopt).inSituScale(), 1.0);
  const PlanResult r = makePlan(t, PlanRequest{});
  EXPECT_FALSE(r.plan.options.inSituScale);
  bool warned = false;
  for (const std::string& warning : r.warnings)
    warned = warned || warning.find("not applied") != std::string::npos;
  EXPECT_TRUE(warned);
}

TEST(InSitu, OneRanksCopiesAreFittedForOneRankOnly) {
  schemas::Trace one = glooTrace(4 * test::kTinyGatherUs);
  one.meta.worldSize = 1;
  const Workload w = makeWorkload(one);
  std::optional<InSituFit> fit;
  const CostModel cost = plannedCostModel(one, w, std::nullopt, nullptr, std::nullopt, &fit);
  ASSERT_TRUE(fit);
  EXPECT_GT(fit->scale, 1.5);
  EXPECT_FALSE(fit->atBound);
  EXPECT_NEAR(defaultStepUs(one, w, cost), w.recordedHostUs, 1e-3 * w.recordedHostUs);
  // A 1-rank run's copies say nothing of a network's collectives.
  EXPECT_FALSE(fitInSitu(one, makeWorkload(one, 2), std::nullopt, nullptr));
}

TEST(InSitu, OnlyCpuRanksRecordedAndPlannedAlikeWithoutABandwidthWhatIf) {
  const schemas::Trace gloo = glooTrace(4 * test::kTinyGatherUs);
  EXPECT_FALSE(fitInSitu(gloo, makeWorkload(gloo), 100.0, nullptr));  // another cluster's bus
  // Planned for one rank from two: its copies are not the recorded collectives.
  EXPECT_FALSE(fitInSitu(gloo, makeWorkload(gloo, 1), std::nullopt, nullptr));
  schemas::Network network;
  network.worldSize = 2;
  network.backend = "gloo";
  network.calibration = gloo.calibration;
  EXPECT_TRUE(fitInSitu(gloo, makeWorkload(gloo), std::nullopt, nullptr));
  EXPECT_FALSE(fitInSitu(gloo, makeWorkload(gloo), std::nullopt, &network));  // another network's contention
  schemas::Trace nccl = gloo;
  nccl.meta.backend = "nccl";
  nccl.meta.device = "cuda";
  EXPECT_FALSE(
      fitInSitu(nccl, makeWorkload(nccl), std::nullopt, nullptr));  // a GPU's waits do not block the host
  schemas::Trace noHost = gloo;
  noHost.steps[0].optimizerHostUs.reset();
  EXPECT_FALSE(fitInSitu(noHost, makeWorkload(noHost), std::nullopt, nullptr));
  std::optional<InSituFit> fit = InSituFit{};
  EXPECT_EQ(
      plannedCostModel(nccl, makeWorkload(nccl), std::nullopt, nullptr, std::nullopt, &fit).inSituScale(),
      1.0);
  EXPECT_FALSE(fit);
}

TEST(PlannedWorkload, CpuRanksComputeAtTheNetworksProbeOverTheTraces) {
  schemas::Trace gloo = glooTrace(4 * test::kTinyGatherUs);
  gloo.calibration.computeProbeUs = 100.0;
  schemas::Network network;
  network.worldSize = 2;
  network.backend = "gloo";
  network.calibration = gloo.calibration;
  network.calibration.computeProbeUs = 230.0;  // the ranks share the cores there
  const Workload recorded = makeWorkload(gloo);
  double factor = 0;
  const Workload w = plannedWorkload(gloo, 0, StepReplay::Issued, &network, &factor);
  EXPECT_DOUBLE_EQ(factor, 2.3);
  for (size_t r = 0; r < w.runs.size(); ++r) {
    for (size_t i = 0; i < w.runs[r].computeUs.size(); ++i) {
      EXPECT_DOUBLE_EQ(w.runs[r].computeUs[i], 2.3 * recorded.runs[r].computeUs[i]);
      EXPECT_DOUBLE_EQ(w.runs[r].hostUs[i], 2.3 * recorded.runs[r].hostUs[i]);
      EXPECT_DOUBLE_EQ(w.runs[r].issueUs[i], 2.3 * recorded.runs[r].issueUs[i]);
    }
  }
  EXPECT_DOUBLE_EQ(w.optimizerUs, 2.3 * recorded.optimizerUs);
  EXPECT_DOUBLE_EQ(w.optimizerHostUs, 2.3 * recorded.optimizerHostUs);
  // dcplan plan applies it (and says so): the same network without its probe plans a faster step.
  PlanRequest probed;
  probed.worldSize = 2;
  probed.network = schemas::PlanNetwork{"net.json", network};
  probed.explain = true;
  PlanRequest unprobed = probed;
  unprobed.network->measured.calibration.computeProbeUs.reset();
  const PlanResult scaled = makePlan(gloo, probed);
  EXPECT_GT(scaled.plan.predicted.stepUs, makePlan(gloo, unprobed).plan.predicted.stepUs);
  bool said = false;
  for (const std::string& line : scaled.explanation) said = said || line.rfind("compute: ", 0) == 0;
  EXPECT_TRUE(said);
  // Kept: no network, a probe missing on either side, or GPUs (each computes on its own).
  const Workload kept = plannedWorkload(gloo, 0, StepReplay::Issued, nullptr, &factor);
  EXPECT_EQ(factor, 1.0);
  EXPECT_EQ(kept.runs[0].computeUs, recorded.runs[0].computeUs);
  schemas::Network old = network;
  old.calibration.computeProbeUs.reset();
  EXPECT_EQ(plannedWorkload(gloo, 0, StepReplay::Issued, &old, &factor).runs[0].computeUs, recorded.runs[0].computeUs);
  EXPECT_EQ(factor, 1.0);
  schemas::Trace nccl = gloo;
  nccl.meta.backend = "nccl";
  nccl.meta.device = "cuda";
  EXPECT_EQ(plannedWorkload(nccl, 0, StepReplay::Issued, &network, &factor).runs[0].computeUs, recorded.runs[0].computeUs);
  EXPECT_EQ(factor, 1.0);
}

PlanRequest calibrated(const Schedule& replayed, double stepUs, int64_t worldSize = 2) {
  PlanRequest req;
  req.calibrate =
      ReplayMeasurement{replayed, worldSize, false, stepUs, "replay.0.jsonl (a replay of p.json)"};
  return req;
}

/// The replayed schedule's step as dcplan inspect simulates a plan (against the default schedule).
double replayedStepUs(const Workload& w, const CostModel& cost, const Schedule& replayed) {
  const SimResult d = simulate(w, cost, compileSchedule(w, defaultSchedule(w)));
  SimOptions o;
  o.referenceCalls = d.calls();
  o.reference = &d;
  return simulate(w, cost, compileSchedule(w, replayed), o).prediction.stepUs;
}

TEST(InSituReplay, APlanIsCalibratedToTheStepItsReplayMeasured) {
  const schemas::Trace t = glooTrace(test::kTinyGatherUs);
  const Workload w = makeWorkload(t);
  const schemas::Plan first = makePlan(t, PlanRequest{}).plan;
  // Its replay measured the step 30% longer than predicted.
  const double measured = 1.3 * first.predicted.stepUs;
  const InSituFit fit = fitToReplay(t, w, scheduleOf(first), measured, std::nullopt, nullptr);
  EXPECT_EQ(fit.source, InSituFit::Source::Replay);
  EXPECT_FALSE(fit.atBound);
  EXPECT_GT(fit.scale, 1.0);
  // Replanned with the scale, the replayed schedule is predicted at the measured step.
  const PlanResult again = makePlan(t, calibrated(scheduleOf(first), measured));
  ASSERT_TRUE(again.plan.options.inSituScale);
  EXPECT_NEAR(*again.plan.options.inSituScale, fit.scale, 1e-12);
  EXPECT_NE(again.inSitu.find("collectives calibrated on a replay"), std::string::npos) << again.inSitu;
  const CostModel cost = plannedCostModel(t, w, std::nullopt, nullptr, again.plan.options.inSituScale);
  EXPECT_NEAR(replayedStepUs(w, cost, scheduleOf(first)), measured, 1e-3 * measured);
}

TEST(InSituReplay, WhatCannotCalibrateIsRefusedSayingWhy) {
  const schemas::Trace t = glooTrace(test::kTinyGatherUs);
  const Schedule replayed = scheduleOf(makePlan(t, PlanRequest{}).plan);
  auto refusal = [&](const PlanRequest& req) {
    try {
      makePlan(t, req);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("planned");
  };
  // A step a hundred times the prediction: neither the collectives nor the host's pace explains it.
  EXPECT_NE(refusal(calibrated(replayed, 1e8))
                .find("no collective time between 0.125x and 8x the calibration's and no pace of the host "
                      "between 0.125x and 8x the recording's explains that (the device, not the "
                      "communication or the host, differs"),
            std::string::npos)
      << refusal(calibrated(replayed, 1e8));
  EXPECT_NE(refusal(calibrated(replayed, 5000, 4)).find("the replayed plan is for 4 ranks, this plan for 2"),
            std::string::npos);
  // Graph replays say nothing of a plan for the host's replay, nor the other way round.
  PlanRequest graph = calibrated(replayed, 5000);
  graph.calibrate->cudaGraph = true;
  EXPECT_NE(refusal(graph).find("the replayed plan ran as one CUDA graph (dcplan.graphed_step), this plan is "
                                "for the host's replay"),
            std::string::npos)
      << refusal(graph);
}

/// The tiny trace as a GPU records it, host-bound: each stretch took the host 3x the device's time;
/// a gather took 60 us to issue, every other op 5 (a launch charge of 55 us).
schemas::Trace hostBoundGpuTrace() {
  schemas::Trace t = test::tinyTrace();
  for (schemas::TraceStep& step : t.steps) {
    step.optimizerHostUs = 50.0;
    for (schemas::TraceGraph& g : step.graphs) {
      for (schemas::OpEvent& e : g.events) {
        e.hostUs = 3 * e.computeUs;
        e.issueUs = e.op == "allgather_param" ? 60.0 : 5.0;
      }
    }
  }
  return t;
}

/// hostBoundGpuTrace with the device-lead step's times (the device's own compute as recorded, the
/// optimizer's 30 us): a trace a CUDA graph's plan can be made from.
schemas::Trace graphTrace() {
  schemas::Trace t = hostBoundGpuTrace();
  for (schemas::TraceStep& step : t.steps) {
    step.optimizerDeviceUs = 30.0;
    for (schemas::TraceGraph& g : step.graphs) {
      for (schemas::OpEvent& e : g.events) e.deviceUs = e.computeUs;
    }
  }
  return t;
}

TEST(InSituReplay, AGraphsReplaysCalibrateTheDevicesPace) {
  schemas::Trace t = graphTrace();
  PlanRequest graphed;
  graphed.cudaGraph = true;
  // Recorded with its captured step 10% under the recorded schedule's simulation: the first plan
  // is fitted to it, and the calibration scales on top of that fit.
  t.meta.graphed = true;
  t.calibration.graphStepUs = 0.9 * makePlan(t, graphed).plan.predictedDefault.stepUs;
  const schemas::Plan first = makePlan(t, graphed).plan;
  ASSERT_TRUE(first.options.cudaGraph);
  EXPECT_FALSE(first.options.deviceScale.has_value());
  // Its graph's replays ran 15% under the prediction (the device-lead step's launch gaps).
  const double measured = 0.85 * first.predicted.stepUs;
  PlanRequest req = calibrated(scheduleOf(first), measured);
  req.cudaGraph = true;
  req.calibrate->cudaGraph = true;
  const PlanResult again = makePlan(t, req);
  ASSERT_TRUE(again.plan.options.deviceScale.has_value());
  const double scale = *again.plan.options.deviceScale;
  EXPECT_LT(scale, 0.85);  // the device's share of the step shrinks by more than the step
  EXPECT_FALSE(again.plan.options.hostScale.has_value());
  EXPECT_FALSE(again.plan.options.inSituScale.has_value());
  EXPECT_NE(again.inSitu.find("device calibrated on a replay of the graph"), std::string::npos) << again.inSitu;
  // The replayed schedule on the fitted and then scaled device times is the measured step.
  std::optional<CapturedStep> captured;
  Workload w = plannedWorkload(t, 0, StepReplay::CudaGraph, nullptr, nullptr, &captured);
  ASSERT_TRUE(captured && !captured->atBound);
  scaleDevice(w, scale);
  EXPECT_NEAR(replayedStepUs(w, plannedCostModel(t, w, std::nullopt), scheduleOf(first)), measured,
              1e-3 * measured);
  // The plan carries the scale; inspect simulates with it, and a plan for the host's replay refuses it.
  schemas::Plan back;
  ASSERT_TRUE(schemas::validatePlan(schemas::parseJson(schemas::writePlan(again.plan), "p"), back).empty());
  EXPECT_EQ(back.options.deviceScale, again.plan.options.deviceScale);
  const std::string report = renderPlanReport(back, "p.json", &t, "t.json");
  EXPECT_NE(report.find("(options.device_scale)"), std::string::npos) << report;
  EXPECT_NE(report.find("step " + schemas::formatMs(again.plan.predicted.stepUs)), std::string::npos) << report;
  nlohmann::json hooks = schemas::parseJson(schemas::writePlan(again.plan), "p");
  hooks["options"]["cuda_graph"] = false;
  schemas::Plan refused;
  const auto diags = schemas::validatePlan(hooks, refused);
  ASSERT_FALSE(diags.empty());
  EXPECT_EQ(diags.front().pointer, "/options/device_scale");
}

TEST(InSituReplay, OnAGpuAReplayWhoseHostRanFasterCalibratesTheHostsPace) {
  // The host paces the step, and its replay ran at 70% of the predicted step (session 35's 4-GPU
  // replays ran each stretch 1.5-1.7x faster on the host than the recording).
  const schemas::Trace t = hostBoundGpuTrace();
  const Workload w = makeWorkload(t);
  ASSERT_TRUE(w.hostLane && !w.waitsBlockHost);
  ASSERT_EQ(measuredLaunchUs(w), 55.0);
  const schemas::Plan first = makePlan(t, PlanRequest{}).plan;
  // The plan issues fewer calls than the recorded run: the launch charge is part of its prediction.
  ASSERT_LT(simulate(w, plannedCostModel(t, w, std::nullopt), compileSchedule(w, scheduleOf(first))).calls(),
            simulate(w, plannedCostModel(t, w, std::nullopt), compileSchedule(w, defaultSchedule(w))).calls());
  const double measured = 0.7 * first.predicted.stepUs;
  const InSituFit fit = fitToReplay(t, w, scheduleOf(first), measured, std::nullopt, nullptr);
  EXPECT_TRUE(fit.host);  // no collective time makes a host-bound step shorter
  EXPECT_FALSE(fit.atBound);
  EXPECT_LT(fit.scale, 0.75);
  EXPECT_EQ(fit.collectiveScale, 1.0);
  // Replanned: the plan carries the pace and the collectives' scale beside it, and inspect
  // simulates the replayed schedule at the measured step.
  const PlanResult again = makePlan(t, calibrated(scheduleOf(first), measured));
  ASSERT_TRUE(again.plan.options.hostScale);
  EXPECT_NEAR(*again.plan.options.hostScale, fit.scale, 1e-12);
  EXPECT_FALSE(again.plan.options.inSituScale);  // a GPU fits no collectives' scale
  EXPECT_NE(again.inSitu.find("host calibrated on a replay"), std::string::npos) << again.inSitu;
  schemas::Plan replayedAgain = again.plan;
  replayedAgain.persistent = first.persistent;
  replayedAgain.graphs = first.graphs;
  const std::string report = renderPlanReport(replayedAgain, "p.json", &t, "t.json");
  const std::string simulated = "simulated on t.json: step ";
  const size_t at = report.find(simulated);
  ASSERT_NE(at, std::string::npos) << report;
  EXPECT_NEAR(std::stod(report.substr(at + simulated.size())) * 1000.0, measured, 1e-3 * measured) << report;
  EXPECT_NE(report.find("host: every host time at "), std::string::npos);
  // On CPU ranks the collectives come first (InSituReplay.APlanIsCalibratedToTheStepItsReplayMeasured).
}

TEST(AgreementChecks, AReplayIsChargedEveryCallsCheckTheRecordingDidNotMake) {
  schemas::Trace t = glooTrace(4 * test::kTinyGatherUs);
  t.meta.checksCollectives = true;
  const Workload w = makeWorkload(t);
  ASSERT_TRUE(w.checksCollectives);
  const CostModel cost = plannedCostModel(t, w, std::nullopt);
  // Before a gather on use as calibrated, before a bucket in situ (a scale that tells them apart).
  ASSERT_GT(cost.checkUs(true), 0.0);
  ASSERT_GT(cost.inSituScale(), 1.5);
  EXPECT_NEAR(cost.checkUs(false), cost.checkUs(true) * cost.inSituScale(), 1e-9);
  // The fit to the recorded run is the same with or without: the recording made no checks.
  schemas::Trace unchecked = t;
  unchecked.meta.checksCollectives = false;
  EXPECT_DOUBLE_EQ(cost.inSituScale(),
                   plannedCostModel(unchecked, makeWorkload(unchecked), std::nullopt).inSituScale());
  const CompiledSchedule def = compileSchedule(w, defaultSchedule(w));
  const SimResult recorded = simulate(w, cost, def);
  EXPECT_EQ(recorded.checkUs, 0.0);
  const SimResult replayed = simulate(w, cost, def, againstRecorded(recorded));
  // Every gather on use, the bucket flushed at end_backward; the host blocks in each check.
  EXPECT_NEAR(replayed.checkUs,
              static_cast<double>(replayed.gatherCalls) * cost.checkUs(true) +
                  static_cast<double>(replayed.reduceCalls) * cost.checkUs(false),
              1e-6);
  EXPECT_NEAR(replayed.prediction.stepUs, recorded.prediction.stepUs + replayed.checkUs, 1e-6);
  // The plan predicts the default schedule as replayed, and says what a check costs.
  PlanRequest req;
  req.explain = true;
  req.strategy = Strategy::Default;
  const PlanResult r = makePlan(t, req);
  EXPECT_NEAR(r.plan.predictedDefault.stepUs, replayed.prediction.stepUs, 1e-3);
  EXPECT_NEAR(r.plan.predicted.stepUs, replayed.prediction.stepUs, 1e-3);
  bool said = false;
  for (const std::string& line : r.explanation)
    said = said || line.find("agreement checks") != std::string::npos;
  EXPECT_TRUE(said);
  // dcplan inspect --trace says what they cost, beside the default schedule's (here the same).
  const std::string shown = renderPlanReport(r.plan, "p.json", &t, "t.json");
  const int64_t calls = replayed.calls();
  const std::string ms = schemas::formatMs(replayed.checkUs);
  EXPECT_NE(shown.find("agreement checks: " + ms + " a step on the host, one before each of " +
                       std::to_string(calls) + " collective calls (the default schedule: " + ms + ", " +
                       std::to_string(calls) + " calls)"),
            std::string::npos)
      << shown;
  // Without the flag: no checks, and neither line is there.
  const PlanResult plain = makePlan(unchecked, req);
  EXPECT_EQ(renderPlanReport(plain.plan, "p.json", &unchecked, "t.json").find("agreement"),
            std::string::npos);
  EXPECT_NEAR(plain.plan.predictedDefault.stepUs, recorded.prediction.stepUs, 1e-3);
  for (const std::string& line : plain.explanation)
    EXPECT_EQ(line.find("agreement checks"), std::string::npos);
}

TEST(AgreementChecks, APlanForOneRankIsNotChargedAWhatIfFromOneRankIs) {
  // One rank has no other to agree with: its replay does not check (DCPLAN_CHECK_COLLECTIVES=auto).
  schemas::Trace t = glooTrace(4 * test::kTinyGatherUs);
  t.meta.checksCollectives = true;
  ASSERT_GT(t.meta.worldSize, 1);
  EXPECT_TRUE(makeWorkload(t).checksCollectives);
  EXPECT_FALSE(makeWorkload(t, 1).checksCollectives);
  PlanRequest req;
  req.explain = true;
  req.strategy = Strategy::Default;
  req.worldSize = 1;
  for (const std::string& line : makePlan(t, req).explanation)
    EXPECT_EQ(line.find("agreement checks"), std::string::npos) << line;
  // A trace of one rank says its replay on more would check (the recorder marks it whatever its
  // ranks): a plan for two charges them.
  schemas::Trace one = t;
  one.meta.worldSize = 1;
  EXPECT_FALSE(makeWorkload(one).checksCollectives);
  EXPECT_TRUE(makeWorkload(one, 2).checksCollectives);
}

TEST(AgreementChecks, APrefetchOrABucketIsChargedInSituAGatherOnUseAsCalibrated) {
  schemas::Trace t = glooTrace(4 * test::kTinyGatherUs);
  t.meta.checksCollectives = true;
  const Workload w = makeWorkload(t);
  const CostModel cost = plannedCostModel(t, w, std::nullopt);
  ASSERT_GT(cost.inSituScale(), 1.5);
  const SimResult recorded = simulate(w, cost, compileSchedule(w, defaultSchedule(w)));
  // Parameter 1 prefetched at the forward's first op; parameter 0 gathered on use.
  Schedule s = defaultSchedule(w);
  schemas::PrefetchGroup early;
  early.position = 0;
  early.dsIds = {1};
  s.graphs[0].prefetch.push_back(early);
  const SimResult r = simulate(w, cost, compileSchedule(w, s), againstRecorded(recorded, /*record=*/true));
  int onUse = 0, prefetches = 0, checks = 0;
  for (const TimelineEvent& e : r.timeline) {
    onUse += e.name == "allgather_param";
    prefetches += e.name == "prefetch_params_fused";
    checks += e.name == "agreement check";
  }
  ASSERT_EQ(prefetches, 1);
  ASSERT_GT(onUse, 0);
  EXPECT_EQ(checks, r.calls());  // the timeline shows each
  EXPECT_NEAR(
      r.checkUs,
      onUse * cost.checkUs(true) + static_cast<double>(prefetches + r.reduceCalls) * cost.checkUs(false),
      1e-6);
}

}  // namespace
}  // namespace dcplan::planner
