// Planned activation offload: what an offloaded save takes off each op's memory and adds to the
// compute as copies, the refusal of a plan whose saves the trace cannot move, and the planner's
// choice below the floor with every master shard offloaded.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "dcplan/planner/activation_offload.h"
#include "dcplan/planner/planner.h"
#include "dcplan/planner/simulator.h"
#include "tiny_trace.h"

namespace dcplan::planner {
namespace {

using schemas::GraphKind;
using test::kTinyBase;
using test::kTinyParam;

constexpr uint64_t kSaved = 409'600;  // one saved activation of layer 0: more than a gathered parameter

/// The tiny trace with one activation saved during layer 0's forward compute (before forward op
/// 2), gone by forward op 3 once on the host, read again by layer 0's backward compute (before
/// backward op 6) and freed there; optimizer state and host link rates as the offload tests have.
schemas::Trace savingTrace() {
  schemas::Trace t = test::offloadableTrace();  // 409,600 bytes in in 409.6 us, out in 819.2 us
  auto& fwd = t.steps[0].graphs[0];
  auto& bwd = t.steps[0].graphs[1];
  for (size_t i = 2; i < fwd.events.size(); ++i) fwd.events[i].memoryBytes += kSaved;
  for (size_t i = 0; i < 6; ++i) bwd.events[i].memoryBytes += kSaved;
  fwd.savedActivations.push_back({{0}, kSaved, 2, 3, 6});
  return t;
}

struct Fixture {
  schemas::Trace trace = savingTrace();
  Workload w = makeWorkload(trace);
  CostModel cost{trace.calibration, 2};

  SimResult run(std::vector<schemas::OffloadedSave> saves) const {
    Schedule s;
    s.graphs.push_back({0, GraphKind::Forward, {}, {}});
    s.graphs[0].offloadSaves = std::move(saves);
    s.graphs.push_back({1, GraphKind::Backward, {}, {{{1, 0}, 0, "float32"}}});
    SimOptions o;
    o.record = true;
    return simulate(w, cost, compileSchedule(w, s), o);
  }
};

TEST(ActivationOffload, ASaveIsOffTheDeviceFromItsFreeToItsRead) {
  Fixture f;
  ASSERT_EQ(f.w.runs[0].saved.size(), 1u);
  EXPECT_EQ(f.w.runs[0].backwardRun, 1);
  SimResult kept = f.run({});
  SimResult moved = f.run({{0, kSaved}});
  // Memory as each op is entered: forward ops 0-5, then backward ops 0-8.
  ASSERT_EQ(kept.entryBytes.size(), 15u);
  ASSERT_EQ(moved.entryBytes.size(), 15u);
  for (size_t i = 0; i < kept.entryBytes.size(); ++i) {
    const bool off = (i >= 3 && i < 6) || (i >= 6 && i < 6 + 6);  // forward from op 3, backward before op 6
    EXPECT_EQ(kept.entryBytes[i] - moved.entryBytes[i], off ? kSaved : 0) << "op " << i;
  }
  // The peak held it (the backward's first ops: gathered 1, its gradient in the bucket); moved, the
  // peak is where layer 0's backward holds both gradients and gathered 0.
  EXPECT_EQ(kept.prediction.peakMemoryBytes, kTinyBase + 2 * kTinyParam + kSaved);
  EXPECT_EQ(moved.prediction.peakMemoryBytes, kTinyBase + 5 * kTinyParam);
  EXPECT_EQ(moved.prediction.activationOffloadBytes, kSaved);
  EXPECT_EQ(kept.prediction.activationOffloadBytes, 0u);
}

TEST(ActivationOffload, EachOpAndStretchHoldsLessFromTheFreeToTheRead) {
  // A second save, made after the forward's last op (in the backward's first stretch, as that
  // compute is) and gone only by the forward's end: off the backward's op 0 but not its first
  // stretch, read before backward op 1.
  schemas::Trace t = savingTrace();
  t.steps[0].graphs[1].events[0].memoryBytes += 4096;
  t.steps[0].graphs[0].savedActivations.push_back({{1}, 4096, 6, 6, 1});
  const Workload w = makeWorkload(t);
  const CompiledActivations c =
      compileActivationOffload(w, {{0, GraphKind::Forward, {}, {}, std::nullopt, {{0, kSaved}, {1, 4096}}},
                                   {1, GraphKind::Backward, {}, {}}});
  ASSERT_NE(c.of(0), nullptr);
  ASSERT_NE(c.of(1), nullptr);
  const CompiledActivations::Run& fwd = *c.of(0);
  const CompiledActivations::Run& bwd = *c.of(1);
  using V = std::vector<uint64_t>;
  const uint64_t s = kSaved;
  // The first: gone by forward op 3 (the stretch before it may still hold it), read before backward op 6.
  EXPECT_EQ(fwd.less, (V{0, 0, 0, s, s, s}));
  EXPECT_EQ(fwd.lessPeak, (V{0, 0, 0, 0, s, s}));
  EXPECT_EQ(fwd.outBytes, (V{0, 0, s, 0, 0, 0}));
  EXPECT_EQ(bwd.less, (V{s + 4096, s, s, s, s, s, 0, 0, 0}));
  EXPECT_EQ(bwd.lessPeak, (V{s, s, s, s, s, s, 0, 0, 0}));
  EXPECT_EQ(bwd.outBytes, (V{4096, 0, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(bwd.inBytes, (V{0, 4096, 0, 0, 0, 0, s, 0, 0}));
  EXPECT_EQ(c.bytes, s + 4096);
}

TEST(ActivationOffload, ItsCopiesLengthenTheComputeTheyRunIn) {
  Fixture f;
  SimResult kept = f.run({});
  SimResult moved = f.run({{0, kSaved}});
  // Out at 0.5 GB/s in layer 0's forward compute, in at 1 GB/s in its backward compute, both on
  // the compute stream: the step is that much longer, and none of it is communication.
  EXPECT_NEAR(moved.prediction.activationCopyUs, 819.2 + 409.6, 1e-9);
  EXPECT_NEAR(moved.prediction.copyInUs, 409.6, 1e-9);  // with the copy bound's other parts
  EXPECT_NEAR(moved.prediction.copyOutUs, 819.2, 1e-9);
  EXPECT_NEAR(moved.prediction.stepUs, kept.prediction.stepUs + 819.2 + 409.6, 1e-6);
  EXPECT_NEAR(moved.prediction.exposedCommUs, kept.prediction.exposedCommUs, 1e-6);
  // The timeline shows them apart from the compute: out before forward op 2, in before backward op 6.
  std::vector<std::pair<int64_t, double>> copies;
  for (const TimelineEvent& e : moved.timeline) {
    if (e.name != "saved activation copies") continue;
    EXPECT_EQ(e.bytes, kSaved);
    copies.emplace_back(e.seq, e.endUs - e.startUs);
  }
  ASSERT_EQ(copies.size(), 2u);
  EXPECT_EQ(copies[0].first, 2);
  EXPECT_NEAR(copies[0].second, 819.2, 1e-6);
  EXPECT_EQ(copies[1].first, 6);
  EXPECT_NEAR(copies[1].second, 409.6, 1e-6);
}

TEST(ActivationOffload, SavesTheTraceCannotMoveAreRefusedByPointer) {
  Fixture f;
  auto compileWith = [&](std::vector<schemas::OffloadedSave> saves) {
    Schedule s;
    s.graphs.push_back({0, GraphKind::Forward, {}, {}});
    s.graphs[0].offloadSaves = std::move(saves);
    s.graphs.push_back({1, GraphKind::Backward, {}, {{{1, 0}, 0, "float32"}}});
    compileSchedule(f.w, s);
  };
  try {
    compileWith({{1, kSaved}});
    FAIL() << "an unknown save was compiled";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(
        std::string(e.what()),
        "/graphs/0/offload_saves/0/pack: save 1 of graph 0 is no saved activation the trace recorded with "
        "freed_at and used_at");
  }
  try {
    compileWith({{0, kSaved + 1}});
    FAIL() << "a save of another size was compiled";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "/graphs/0/offload_saves/0/bytes: expected 409600 (the trace's), got 409601");
  }
  // Without freed_at (no trial ran) a save cannot move.
  schemas::Trace untried = savingTrace();
  untried.steps[0].graphs[0].savedActivations[0].freedAt.reset();
  EXPECT_TRUE(offloadableSaves(makeWorkload(untried), 0).empty());
  EXPECT_EQ(offloadableSaves(f.w, 0).size(), 1u);
}

TEST(ActivationOffload, PlannerMovesSavesBelowTheFloorWithEveryMasterShardOffloaded) {
  const schemas::Trace t = savingTrace();
  PlanRequest req;
  std::string floors;
  req.memoryBudgetBytes = 1;
  try {
    makePlan(t, req);
    FAIL() << "a 1-byte budget was planned";
  } catch (const std::invalid_argument& e) {
    floors = e.what();
  }
  // The floor with every master shard offloaded holds the save; with it offloaded too, the peak
  // is layer 0's backward (gathered 0 and both gradients, one in the bucket).
  auto floorAfter = [&](const std::string& marker) {
    const size_t at = floors.find(marker);
    EXPECT_NE(at, std::string::npos) << floors;
    return at == std::string::npos ? 0.0 : std::stod(floors.substr(at + marker.size()));
  };
  const double masters = floorAfter("; and with the master shards offloaded too (100 KiB more): at least ");
  const double saves =
      floorAfter("; and with every saved activation offloaded too (400 KiB a step): at least ");
  ASSERT_LT(saves, masters) << floors;
  // Between the two floors (MiB): the save goes to the host, and the plan keeps the budget.
  req.memoryBudgetBytes = static_cast<uint64_t>((saves + masters) / 2 * (1 << 20));
  req.explain = true;
  PlanResult r = makePlan(t, req);
  ASSERT_EQ(r.plan.graphs.size(), 2u);
  ASSERT_EQ(r.plan.graphs[0].offloadSaves.size(), 1u);
  EXPECT_EQ(r.plan.graphs[0].offloadSaves[0].pack, 0);
  EXPECT_LE(r.plan.predicted.peakMemoryBytes, plannedLimit(*req.memoryBudgetBytes));
  EXPECT_EQ(r.plan.predicted.activationOffloadBytes, kSaved);
  bool explained = false;
  for (const std::string& line : r.explanation) {
    explained |= line.rfind("offload: no schedule fits with every master shard offloaded either", 0) == 0;
  }
  EXPECT_TRUE(explained);
}

}  // namespace
}  // namespace dcplan::planner
