// Property tests of the planner over many generated traces: budget, ordering, determinism, round trip.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "dcplan/planner/planner.h"
#include "dcplan/planner/simulator.h"
#include "dcplan/planner/workload.h"
#include "dcplan/schemas/io.h"
#include "dcplan/testing/trace_generator.h"
#include "tiny_trace.h"

namespace dcplan::planner {
namespace {

struct Case {
  int64_t layers, hidden, tokens, world, accum, stage;
  uint64_t seed;
};

std::string name(const Case& c) {
  return "layers=" + std::to_string(c.layers) + " hidden=" + std::to_string(c.hidden) +
         " tokens=" + std::to_string(c.tokens) + " world=" + std::to_string(c.world) +
         " accum=" + std::to_string(c.accum) + " stage=" + std::to_string(c.stage) +
         " seed=" + std::to_string(c.seed);
}

schemas::Trace generate(const Case& c) {
  testing::GeneratorOptions o;
  o.model.layers = c.layers;
  o.model.hidden = c.hidden;
  o.model.heads = std::max<int64_t>(1, c.hidden / 128);
  o.model.vocab = 8000;
  o.model.tokensPerRank = c.tokens;
  o.worldSize = c.world;
  o.gradAccumSteps = c.accum;
  o.stage = c.stage;
  o.steps = 1;
  o.seed = c.seed;
  return testing::generateTrace(o);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  uint64_t seed = 1;
  for (int64_t layers : {1, 3, 6}) {
    for (int64_t hidden : {256, 1024}) {
      for (int64_t tokens : {256, 4096}) {
        for (int64_t world : {2, 8}) {
          out.push_back({layers, hidden, tokens, world, seed % 3 == 0 ? 2 : 1, seed % 5 == 0 ? 2 : 3, seed});
          ++seed;
        }
      }
    }
  }
  return out;
}

PlanResult plan(const schemas::Trace& t, Strategy s, std::optional<uint64_t> budget) {
  PlanRequest r;
  r.strategy = s;
  r.memoryBudgetBytes = budget;
  r.traceName = "generated.json";
  return makePlan(t, r);
}

TEST(PlannerProperties, BudgetOrderingDeterminismAndRoundTrip) {
  int checked = 0;
  for (const Case& c : cases()) {
    SCOPED_TRACE(name(c));
    schemas::Trace trace = generate(c);
    uint64_t defaultPeak = plan(trace, Strategy::Default, std::nullopt).plan.predicted.peakMemoryBytes;
    // From barely above the default's peak after the reserve (prefetch squeezed) to roomy.
    for (double slack : {0.007, 0.05, 0.5}) {
      SCOPED_TRACE("slack=" + std::to_string(slack));
      auto budget = static_cast<uint64_t>(static_cast<double>(defaultPeak) * (1 + slack));
      PlanResult opt = plan(trace, Strategy::Optimized, budget);
      PlanResult heur = plan(trace, Strategy::Heuristic, budget);
      PlanResult def = plan(trace, Strategy::Default, budget);
      const schemas::Prediction& p = opt.plan.predicted;
      EXPECT_LE(p.peakMemoryBytes, plannedLimit(budget));
      EXPECT_LE(p.stepUs, def.plan.predicted.stepUs + 1e-3);
      if (heur.plan.predicted.peakMemoryBytes <= budget) {
        EXPECT_LE(p.stepUs, heur.plan.predicted.stepUs + 1e-3);
      }
      EXPECT_LE(heur.plan.predicted.peakMemoryBytes, plannedLimit(budget));  // the reference's own check
      EXPECT_EQ(opt.plan.predictedDefault.stepUs, def.plan.predicted.stepUs);
      EXPECT_GE(p.exposedCommUs, 0);

      // Deterministic: byte-identical output.
      std::string text = schemas::writePlan(opt.plan);
      EXPECT_EQ(text, schemas::writePlan(plan(trace, Strategy::Optimized, budget).plan));

      // Round trip through the writer and the validator.
      schemas::Plan back;
      auto diags = schemas::validatePlan(schemas::parseJson(text, "plan"), back);
      EXPECT_TRUE(diags.empty()) << (diags.empty() ? "" : diags[0].str());
      EXPECT_EQ(schemas::writePlan(back), text);

      // The prediction is what the simulator says of the written plan.
      Workload w = makeWorkload(trace, back.source.worldSize);
      CostModel cost(trace.calibration, trace.meta.worldSize,
                     {back.source.worldSize, back.options.bandwidthGBps, std::nullopt});
      SimOptions withLaunches;
      withLaunches.referenceCalls = recordedCalls(w, cost);
      SimResult again = simulate(w, cost, compileSchedule(w, scheduleOf(back)), withLaunches);
      EXPECT_NEAR(again.prediction.stepUs, p.stepUs, 1e-3);
      EXPECT_EQ(again.prediction.peakMemoryBytes, p.peakMemoryBytes);
      ++checked;
    }
  }
  EXPECT_EQ(checked, 24 * 3);
}

TEST(PlannerProperties, OptimizedBeatsTheHeuristicOnATightBudget) {
  testing::GeneratorOptions o;
  o.model.layers = 8;
  o.model.hidden = 2048;
  o.model.heads = 16;
  o.model.tokensPerRank = 4096;
  o.worldSize = 8;
  o.steps = 1;
  schemas::Trace t = testing::generateTrace(o);
  uint64_t defaultPeak = plan(t, Strategy::Default, std::nullopt).plan.predicted.peakMemoryBytes;
  // 0.4% above the default's peak, after the reserve.
  const uint64_t limit = defaultPeak + (defaultPeak >> 8);
  const auto budget = static_cast<uint64_t>(static_cast<double>(limit) / (1 - kUnseenReserveShare)) + 1;
  ASSERT_GE(plannedLimit(budget), limit);
  PlanResult opt = plan(t, Strategy::Optimized, budget);
  PlanResult heur = plan(t, Strategy::Heuristic, budget);
  EXPECT_LT(opt.plan.predicted.stepUs, heur.plan.predicted.stepUs);
  EXPECT_LT(opt.plan.predicted.exposedCommUs, 0.5 * opt.plan.predictedDefault.exposedCommUs);
}

TEST(PlannerProperties, GradientAccumulationMakesPersistenceWorthMore) {
  // With 4 micro-steps a parameter is gathered 8 times per optimizer step, not 2: keeping the
  // same parameters saves more of the step, and the plan keeps some.
  auto trace = [](int64_t accum) {
    testing::GeneratorOptions o;
    o.model.layers = 4;
    o.model.hidden = 1024;
    o.model.tokensPerRank = 256;  // communication-bound: persistence pays
    o.gradAccumSteps = accum;
    o.steps = 1;
    return testing::generateTrace(o);
  };
  auto savedUs = [](const schemas::Trace& t) {
    Workload w = makeWorkload(t);
    CostModel cost{t.calibration, w.worldSize};
    Schedule onUse = defaultSchedule(w);
    Schedule kept = onUse;
    for (const WorkParam& p : w.params) kept.persistent.push_back(p.id);
    auto step = [&](const Schedule& s) {
      return simulate(w, cost, compileSchedule(w, s), SimOptions{}).prediction.stepUs;
    };
    return step(onUse) - step(kept);
  };
  const double one = savedUs(trace(1));
  const double four = savedUs(trace(4));
  EXPECT_GT(one, 0);
  EXPECT_GT(four, 2 * one);
  EXPECT_FALSE(plan(trace(4), Strategy::Optimized, std::nullopt).plan.persistent.empty());
}

TEST(PlannerProperties, PersistenceFitsWhereTheOptimizerStepSetsThePeak) {
  // The optimizer step (in the window before the step's first op) peaks 2 MB above anything
  // forward or backward hold: with that peak as the budget, keeping parameters costs no peak.
  schemas::Trace t = test::tinyTrace();
  schemas::OpEvent& first = t.steps[0].graphs[0].events[0];
  first.peakBytes = first.memoryBytes + 2'000'000;
  const uint64_t floor = plan(t, Strategy::Default, std::nullopt).plan.predicted.peakMemoryBytes;
  EXPECT_EQ(floor, first.peakBytes);
  // The budget that leaves the floor after the reserve for what the model does not see.
  const uint64_t budget = floor + floor / 199 + 1;
  ASSERT_GE(plannedLimit(budget), floor);
  PlanResult r = plan(t, Strategy::Optimized, budget);
  EXPECT_FALSE(r.plan.persistent.empty());
  EXPECT_LE(r.plan.predicted.peakMemoryBytes, floor);
  // The floor itself as the budget leaves less than the floor: refused.
  EXPECT_THROW(plan(t, Strategy::Optimized, floor), std::invalid_argument);
}

TEST(PlannerProperties, PlansKeepAReserveForWhatTheModelDoesNotSee) {
  EXPECT_EQ(plannedLimit(1'000'000), 995'000u);
  EXPECT_EQ(plannedLimit(0), 0u);
  testing::GeneratorOptions o;
  o.model.layers = 2;
  o.worldSize = 4;
  o.steps = 1;
  schemas::Trace t = testing::generateTrace(o);
  const uint64_t peak = plan(t, Strategy::Default, std::nullopt).plan.predicted.peakMemoryBytes;
  for (double f : {1.01, 1.05, 1.2}) {
    const auto budget = static_cast<uint64_t>(static_cast<double>(peak) * f);
    PlanResult r = plan(t, Strategy::Optimized, budget);
    EXPECT_LE(r.plan.predicted.peakMemoryBytes, plannedLimit(budget)) << f;
  }
}

TEST(PlannerProperties, WhatIfWorldSizeAndBandwidth) {
  testing::GeneratorOptions o;
  o.model.layers = 2;
  o.model.hidden = 1024;
  o.worldSize = 8;
  o.steps = 1;
  schemas::Trace t = testing::generateTrace(o);
  PlanRequest r;
  r.traceName = "t.json";
  r.worldSize = 32;
  PlanResult wide = makePlan(t, r);
  EXPECT_EQ(wide.plan.source.worldSize, 32);
  EXPECT_EQ(wide.plan.source.paramSignature, schemas::paramSignature(t.params, 32));
  EXPECT_NE(wide.plan.source.paramSignature, schemas::paramSignature(t.params, 8));
  r.worldSize = 0;
  r.bandwidthGBps = 25;  // a tenth of the traced cluster's
  PlanResult slow = makePlan(t, r);
  r.bandwidthGBps.reset();
  PlanResult traced = makePlan(t, r);
  EXPECT_GT(slow.plan.predictedDefault.stepUs, traced.plan.predictedDefault.stepUs);
  EXPECT_EQ(slow.plan.options.bandwidthGBps, 25);
}

TEST(PlannerProperties, ImpossibleBudgetIsAnErrorThatSaysWhatWouldFit) {
  schemas::Trace t = test::tinyTrace();
  try {
    plan(t, Strategy::Optimized, 1000);
    ADD_FAILURE() << "planned under 1000 bytes";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("is below what any schedule needs: at least"), std::string::npos)
        << e.what();
  }
  PlanResult d = plan(t, Strategy::Default, 1000);
  ASSERT_EQ(d.warnings.size(), 1u);
  EXPECT_NE(d.warnings[0].find("over the memory limit"), std::string::npos);
}

TEST(PlannerProperties, ExplainSaysWhyForEveryDecision) {
  schemas::Trace t = test::tinyTrace();
  PlanRequest r;
  r.traceName = "tiny.json";
  r.explain = true;
  PlanResult res = makePlan(t, r);
  std::string all;
  for (const auto& l : res.explanation) all += l + "\n";
  EXPECT_NE(all.find("buckets: "), std::string::npos) << all;
  EXPECT_NE(all.find("persistent: "), std::string::npos) << all;
  EXPECT_NE(all.find("id 1 layer1.weight: used at"), std::string::npos) << all;
  EXPECT_NE(all.find("chosen: "), std::string::npos) << all;
}

}  // namespace
}  // namespace dcplan::planner
