// Good documents survive read + write byte for byte; signatures and digests are stable.
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "dcplan/schemas/io.h"
#include "dcplan/schemas/network.h"
#include "dcplan/schemas/trace_merge.h"
#include "dcplan/testing/trace_generator.h"

namespace dcplan::schemas {
namespace {

std::string readText(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

const std::filesystem::path kInputs = std::filesystem::path(DCPLAN_SOURCE_DIR) / "tests/lit/Inputs";

TEST(RoundTrip, MinimalTraceFileIsRewrittenByteIdentically) {
  const auto path = kInputs / "minimal.trace.json";
  EXPECT_EQ(writeTrace(readTrace(path)), readText(path));
}

TEST(RoundTrip, MinimalPlanFileIsRewrittenByteIdentically) {
  const auto path = kInputs / "minimal.plan.json";
  EXPECT_EQ(writePlan(readPlan(path)), readText(path));
}

TEST(RoundTrip, ExampleTraceIsRewrittenByteIdentically) {
  const auto path = std::filesystem::path(DCPLAN_SOURCE_DIR) / "examples/llama-tiny.trace.json";
  EXPECT_EQ(writeTrace(readTrace(path)), readText(path));
}

TEST(RoundTrip, GeneratedTracesSurviveWriteParseWrite) {
  for (int64_t ws : {1, 2, 3, 8}) {
    testing::GeneratorOptions o;
    o.model.layers = 2;
    o.model.hidden = 96;
    o.model.heads = 4;
    o.model.vocab = 1000;
    o.model.tiedEmbedding = ws == 3;
    o.worldSize = ws;
    o.gradAccumSteps = ws == 2 ? 2 : 1;
    o.seed = static_cast<uint64_t>(ws);
    const std::string text = writeTrace(testing::generateTrace(o));
    Trace parsed;
    auto diags = validateTrace(parseJson(text, "generated"), parsed);
    ASSERT_TRUE(diags.empty()) << diags.front().str();
    EXPECT_EQ(writeTrace(parsed), text) << "world size " << ws;
  }
}

TEST(RoundTrip, HostTimesStayAbsentOrPresent) {
  Trace trace = readTrace(kInputs / "minimal.trace.json");
  ASSERT_FALSE(trace.steps.front().optimizerHostUs);  // an older trace: no host lane
  const std::string before = writeTrace(trace);
  EXPECT_EQ(before.find("host_us"), std::string::npos);
  trace.steps.front().optimizerHostUs = 12.5;
  OpEvent& e = trace.steps.front().graphs.front().events.front();
  e.hostUs = 3.25;
  e.issueUs = 0;  // present and zero is not absent
  const std::string text = writeTrace(trace);
  Trace parsed;
  auto diags = validateTrace(parseJson(text, "with host times"), parsed);
  ASSERT_TRUE(diags.empty()) << diags.front().str();
  EXPECT_EQ(parsed.steps.front().optimizerHostUs, 12.5);
  EXPECT_EQ(parsed.steps.front().graphs.front().events.front().hostUs, 3.25);
  EXPECT_EQ(parsed.steps.front().graphs.front().events.front().issueUs, 0.0);
  EXPECT_FALSE(parsed.steps.front().graphs.front().events.back().hostUs);
  EXPECT_EQ(writeTrace(parsed), text);
}

TEST(RoundTrip, OptionalPlanFieldsStayAbsentOrPresent) {
  Plan plan = readPlan(kInputs / "minimal.plan.json");
  plan.options.memoryBudgetBytes.reset();
  plan.options.bandwidthGBps = 12.5;
  const std::string text = writePlan(plan);
  EXPECT_EQ(text.find("memory_budget_bytes"), std::string::npos);
  Plan again;
  ASSERT_TRUE(validatePlan(parseJson(text, "plan"), again).empty());
  EXPECT_FALSE(again.options.memoryBudgetBytes.has_value());
  ASSERT_TRUE(again.options.bandwidthGBps.has_value());
  EXPECT_EQ(*again.options.bandwidthGBps, 12.5);
  EXPECT_EQ(writePlan(again), text);
  // Planned offload: absent without one, its groups and prediction kept with one.
  EXPECT_EQ(text.find("offload"), std::string::npos);
  plan.optimizerOffload = {{{0}, 64, 32}};
  plan.predicted.offloadBytes = 64;
  plan.predicted.reloadUs = 1.5;
  plan.predicted.offloadUs = 2.5;
  plan.predicted.exposedCopyUs = 0.5;
  const std::string offloaded = writePlan(plan);
  Plan back;
  ASSERT_TRUE(validatePlan(parseJson(offloaded, "plan"), back).empty());
  ASSERT_EQ(back.optimizerOffload.size(), 1u);
  EXPECT_EQ(back.optimizerOffload[0].dsIds, std::vector<int64_t>{0});
  EXPECT_EQ(back.optimizerOffload[0].masterBytes, 32u);
  EXPECT_NE(offloaded.find("\"master_bytes\": 32"), std::string::npos);
  EXPECT_EQ(back.predicted.offloadUs, 2.5);
  EXPECT_EQ(back.predictedDefault.offloadBytes, 0u);
  EXPECT_EQ(writePlan(back), offloaded);
  // What the budget guard reads: absent without a budget, kept (a peak of 0 too) with one.
  EXPECT_EQ(text.find("guard"), std::string::npos);
  EXPECT_EQ(text.find("peak_bytes\""), std::string::npos);
  plan.guard = Plan::Guard{1024, std::vector<uint64_t>(plan.persistent.size(), 4096)};
  ASSERT_FALSE(plan.graphs.empty() || plan.graphs[0].prefetch.empty());
  plan.graphs[0].prefetch[0].peakBytes = 0;
  const std::string guarded = writePlan(plan);
  Plan kept;
  ASSERT_TRUE(validatePlan(parseJson(guarded, "plan"), kept).empty());
  ASSERT_TRUE(kept.guard.has_value());
  EXPECT_EQ(kept.guard->startBytes, 1024u);
  EXPECT_EQ(kept.guard->persistentPeakBytes, plan.guard->persistentPeakBytes);
  ASSERT_TRUE(kept.graphs[0].prefetch[0].peakBytes.has_value());
  EXPECT_EQ(*kept.graphs[0].prefetch[0].peakBytes, 0u);
  EXPECT_EQ(writePlan(kept), guarded);
}

/// A network file of 2 CPU ranks' collectives.
Network twoRanks() {
  Network n;
  n.createdBy = "test";
  n.worldSize = 2;
  n.backend = "gloo";
  n.device = "cpu";
  n.calibration.allGather = {{65'536, 120.5}, {262'144, 300.25}};
  n.calibration.reduceScatter = {{65'536, 130.0}};
  n.calibration.allReduce = {{65'536, 260.0}};
  return n;
}

TEST(RoundTrip, ANetworkFileAndAPlansNetworkSurviveWriteParseWrite) {
  Network n = twoRanks();
  n.calibration.computeProbeUs = 1234.5;
  const std::string text = writeNetwork(n);
  Network back;
  ASSERT_TRUE(validateNetwork(parseJson(text, "net"), back).empty());
  EXPECT_EQ(back.worldSize, 2);
  EXPECT_EQ(back.calibration.computeProbeUs, 1234.5);
  EXPECT_EQ(back.calibration.allGather.size(), 2u);
  EXPECT_EQ(writeNetwork(back), text);
  EXPECT_EQ(detectKind(parseJson(text, "net"), "net"), DocumentKind::Network);

  Plan plan = readPlan(kInputs / "minimal.plan.json");
  EXPECT_EQ(writePlan(plan).find("\"network\""), std::string::npos);  // absent without --network
  plan.options.network = PlanNetwork{"net.json", back};
  const std::string planned = writePlan(plan);
  Plan again;
  ASSERT_TRUE(validatePlan(parseJson(planned, "plan"), again).empty());
  ASSERT_TRUE(again.options.network);
  EXPECT_EQ(again.options.network->file, "net.json");
  EXPECT_EQ(again.options.network->measured.calibration.allGather[1].us, 300.25);
  EXPECT_EQ(writePlan(again), planned);
}

TEST(RoundTrip, ReplayModeIsAbsentForEagerAndKeptForCompiled) {
  Trace trace = readTrace(kInputs / "minimal.trace.json");
  Plan plan = readPlan(kInputs / "minimal.plan.json");
  EXPECT_EQ(trace.meta.replay, "eager");
  EXPECT_EQ(plan.source.replay, "eager");
  trace.meta.replay = "compiled";
  plan.source.replay = "compiled";
  Trace t2;
  Plan p2;
  ASSERT_TRUE(validateTrace(parseJson(writeTrace(trace), "trace"), t2).empty());
  ASSERT_TRUE(validatePlan(parseJson(writePlan(plan), "plan"), p2).empty());
  EXPECT_EQ(t2.meta.replay, "compiled");
  EXPECT_EQ(p2.source.replay, "compiled");
  EXPECT_EQ(writePlan(p2), writePlan(plan));
  // A step run in dcplan.graphed_step, and a plan calibrated on a replay: written only when set.
  EXPECT_FALSE(t2.meta.graphed);
  EXPECT_EQ(writeTrace(trace).find("graphed"), std::string::npos);
  EXPECT_FALSE(t2.meta.checksCollectives);
  EXPECT_EQ(writeTrace(trace).find("checks_collectives"), std::string::npos);
  trace.meta.graphed = true;
  trace.meta.checksCollectives = true;
  plan.options.inSituScale = 2.5;
  plan.options.hostScale = 0.75;
  ASSERT_TRUE(validateTrace(parseJson(writeTrace(trace), "trace"), t2).empty());
  ASSERT_TRUE(validatePlan(parseJson(writePlan(plan), "plan"), p2).empty());
  EXPECT_TRUE(t2.meta.graphed);
  EXPECT_TRUE(t2.meta.checksCollectives);
  EXPECT_EQ(p2.options.inSituScale, 2.5);
  EXPECT_EQ(p2.options.hostScale, 0.75);
}

TEST(RoundTrip, InputShapesStayAbsentOrPresent) {
  Trace trace = readTrace(kInputs / "minimal.trace.json");
  Plan plan = readPlan(kInputs / "minimal.plan.json");
  EXPECT_EQ(writeTrace(trace).find("input_shapes"), std::string::npos);
  EXPECT_EQ(writePlan(plan).find("input_shapes"), std::string::npos);
  const InputShapes shapes{{4, 128}, {}, {4, 128, 3}};
  trace.steps[0].graphs[0].inputShapes = shapes;
  plan.graphs[0].inputShapes = shapes;
  Trace t2;
  Plan p2;
  ASSERT_TRUE(validateTrace(parseJson(writeTrace(trace), "trace"), t2).empty());
  ASSERT_TRUE(validatePlan(parseJson(writePlan(plan), "plan"), p2).empty());
  EXPECT_EQ(t2.steps[0].graphs[0].inputShapes, shapes);
  EXPECT_FALSE(t2.steps[0].graphs[1].inputShapes.has_value());
  EXPECT_EQ(p2.graphs[0].inputShapes, shapes);
  EXPECT_EQ(writePlan(p2), writePlan(plan));
}

TEST(RoundTrip, SavedActivationsStayAbsentOrPresent) {
  Trace trace = readTrace(kInputs / "minimal.trace.json");
  EXPECT_EQ(writeTrace(trace).find("saved_activations"), std::string::npos);
  SavedActivation tried{{0, 2}, 65536, 0, 3, 5};
  SavedActivation held{{1}, 131072, 1, std::nullopt, std::nullopt};
  trace.steps[0].graphs[0].savedActivations = {tried, held};
  Trace t2;
  ASSERT_TRUE(validateTrace(parseJson(writeTrace(trace), "trace"), t2).empty());
  const auto& saved = t2.steps[0].graphs[0].savedActivations;
  ASSERT_EQ(saved.size(), 2u);
  EXPECT_EQ(saved[0].packs, (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(saved[0].bytes, 65536u);
  EXPECT_EQ(saved[0].freedAt, 3);
  EXPECT_EQ(saved[0].usedAt, 5);
  EXPECT_EQ(saved[1].seq, 1);
  EXPECT_FALSE(saved[1].freedAt.has_value());
  EXPECT_FALSE(saved[1].usedAt.has_value());
  EXPECT_TRUE(t2.steps[0].graphs[1].savedActivations.empty());
  EXPECT_EQ(writeTrace(t2), writeTrace(trace));
}

TEST(RoundTrip, AGraphedRecordingsCapturedStepTimeIsATracesOwn) {
  Trace trace = readTrace(kInputs / "minimal.trace.json");
  EXPECT_EQ(writeTrace(trace).find("graph_step_us"), std::string::npos);  // absent: not timed
  trace.meta.graphed = true;
  trace.calibration.graphStepUs = 23630.5;
  const std::string text = writeTrace(trace);
  Trace back;
  ASSERT_TRUE(validateTrace(parseJson(text, "trace"), back).empty());
  EXPECT_EQ(back.calibration.graphStepUs, 23630.5);
  EXPECT_EQ(writeTrace(back), text);
  // A time is positive; the error names the field.
  nlohmann::json zero = parseJson(text, "trace");
  zero["calibration"]["graph_step_us"] = 0;
  Trace refused;
  auto diags = validateTrace(zero, refused);
  ASSERT_FALSE(diags.empty());
  EXPECT_EQ(diags.front().pointer, "/calibration/graph_step_us");
  // Only a recording through dcplan.graphed_step times a captured step.
  nlohmann::json eager = parseJson(text, "trace");
  eager["meta"].erase("graphed");
  diags = validateTrace(eager, refused);
  ASSERT_FALSE(diags.empty());
  EXPECT_EQ(diags.front().pointer, "/calibration/graph_step_us");
  EXPECT_NE(diags.front().message.find("only beside meta.graphed"), std::string::npos) << diags.front().str();
  // A network file measures collectives alone: it has no step to time.
  nlohmann::json net = parseJson(writeNetwork(twoRanks()), "net");
  net["calibration"]["graph_step_us"] = 100.0;
  Network notRead;
  diags = validateNetwork(net, notRead);
  ASSERT_FALSE(diags.empty());
  EXPECT_EQ(diags.front().pointer, "/calibration/graph_step_us");
}

TEST(TraceMerge, TheCapturedStepIsTheSlowestRanksAndNeedsEveryRanks) {
  RankTrace r0{0, "rank0.trace.json", readTrace(kInputs / "minimal.trace.json")};
  r0.trace.meta.worldSize = 2;
  r0.trace.calibration.graphStepUs = 1000.0;
  RankTrace r1{1, "rank1.trace.json", r0.trace};
  r1.trace.calibration.graphStepUs = 1200.0;
  EXPECT_EQ(mergeRankTraces({r0, r1}).calibration.graphStepUs, 1200.0);
  // A rank that did not time it (its script shut down first): the step's time is not known.
  r1.trace.calibration.graphStepUs.reset();
  EXPECT_FALSE(mergeRankTraces({r0, r1}).calibration.graphStepUs.has_value());
}

TEST(RoundTrip, ACalibrationPointsDeviceTimeIsWrittenReadAndMergedAsTheSlowestRanks) {
  Trace trace = readTrace(kInputs / "minimal.trace.json");
  EXPECT_EQ(writeTrace(trace).find("device_us"), std::string::npos);  // absent: not timed (CPU)
  ASSERT_GE(trace.calibration.allGather.size(), 2u);
  trace.calibration.allGather[0].deviceUs = 3.25;
  trace.calibration.allGather[1].deviceUs = 7.5;
  const std::string text = writeTrace(trace);
  Trace back;
  ASSERT_TRUE(validateTrace(parseJson(text, "trace"), back).empty());
  EXPECT_EQ(back.calibration.allGather[0].deviceUs, 3.25);
  EXPECT_EQ(writeTrace(back), text);
  // A time is not negative; the error names the point.
  nlohmann::json negative = parseJson(text, "trace");
  negative["calibration"]["all_gather"][1]["device_us"] = -1;
  Trace refused;
  auto diags = validateTrace(negative, refused);
  ASSERT_FALSE(diags.empty());
  EXPECT_EQ(diags.front().pointer, "/calibration/all_gather/1/device_us");
  // A network file carries them too (dcplan plan --network plans a graph with them).
  Network net = twoRanks();
  net.calibration.allGather[0].deviceUs = 9.0;
  Network netBack;
  ASSERT_TRUE(validateNetwork(parseJson(writeNetwork(net), "net"), netBack).empty());
  EXPECT_EQ(netBack.calibration.allGather[0].deviceUs, 9.0);
  EXPECT_TRUE(sameCollectives(net, netBack));
  EXPECT_FALSE(sameCollectives(twoRanks(), netBack));

  RankTrace r0{0, "rank0.trace.json", back};
  r0.trace.meta.worldSize = 2;
  RankTrace r1{1, "rank1.trace.json", r0.trace};
  r1.trace.calibration.allGather[0].deviceUs = 4.0;
  r1.trace.calibration.allGather[1].deviceUs.reset();  // that rank's device caught up every time
  const Trace merged = mergeRankTraces({r0, r1});
  EXPECT_EQ(merged.calibration.allGather[0].deviceUs, 4.0);
  EXPECT_FALSE(merged.calibration.allGather[1].deviceUs.has_value());
}

TEST(TraceMerge, RanksThatDisagreeOnTheReplaysChecksAreRefused) {
  RankTrace r0{0, "rank0.trace.json", readTrace(kInputs / "minimal.trace.json")};
  r0.trace.meta.worldSize = 2;
  RankTrace r1{1, "rank1.trace.json", r0.trace};
  r1.trace.meta.checksCollectives = true;
  try {
    mergeRankTraces({r0, r1});
    FAIL() << "merged ranks that disagree on meta.checks_collectives";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("/meta/checks_collectives"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank1.trace.json"), std::string::npos) << e.what();
  }
}

TEST(TraceMerge, SavedActivationsAreWhatEveryRankSavedAliveAtTheLatestFreeAndEarliestRead) {
  RankTrace r0{0, "rank0.trace.json", readTrace(kInputs / "minimal.trace.json")};
  r0.trace.meta.worldSize = 2;
  RankTrace r1{1, "rank1.trace.json", r0.trace};
  auto& s0 = r0.trace.steps[0].graphs[0].savedActivations;
  auto& s1 = r1.trace.steps[0].graphs[0].savedActivations;
  s0 = {
      {{0, 2}, 65536, 0, 1, 4}, {{1}, 4096, 1, 2, 3}, {{3}, 4096, 2, 3, 2}, {{4}, 8192, 2, std::nullopt, 1}};
  s1 = {
      {{0, 2}, 65536, 1, 2, 3}, {{1}, 8192, 1, 2, 3}, {{3}, 4096, 1, std::nullopt, 1}, {{4}, 8192, 2, 3, 0}};
  const Trace merged = mergeRankTraces({r0, r1});
  const auto& m = merged.steps[0].graphs[0].savedActivations;
  // Save 1 differs in size between the ranks: left out. The others: the earlier first save, the
  // later free, the earlier read; a free or read one rank did not find is absent.
  ASSERT_EQ(m.size(), 3u);
  EXPECT_EQ(m[0].packs, (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(m[0].seq, 0);
  EXPECT_EQ(m[0].freedAt, 2);
  EXPECT_EQ(m[0].usedAt, 3);
  EXPECT_EQ(m[1].packs, (std::vector<int64_t>{3}));
  EXPECT_FALSE(m[1].freedAt.has_value());
  EXPECT_EQ(m[1].usedAt, 1);
  EXPECT_FALSE(m[2].freedAt.has_value());
  EXPECT_EQ(m[2].usedAt, 0);
}

TEST(RoundTrip, OffloadedSavesStayAbsentOrPresent) {
  Plan plan = readPlan(kInputs / "minimal.plan.json");
  EXPECT_EQ(writePlan(plan).find("offload_saves"), std::string::npos);
  EXPECT_EQ(writePlan(plan).find("activation_"), std::string::npos);
  plan.graphs[0].offloadSaves = {{0, 65536}, {4, 131072}};
  plan.predicted.activationOffloadBytes = 196'608;
  plan.predicted.activationCopyUs = 12.5;
  Plan p2;
  ASSERT_TRUE(validatePlan(parseJson(writePlan(plan), "plan"), p2).empty());
  ASSERT_EQ(p2.graphs[0].offloadSaves.size(), 2u);
  EXPECT_EQ(p2.graphs[0].offloadSaves[1].pack, 4);
  EXPECT_EQ(p2.graphs[0].offloadSaves[1].bytes, 131072u);
  EXPECT_TRUE(p2.graphs[1].offloadSaves.empty());
  EXPECT_EQ(p2.predicted.activationOffloadBytes, 196'608u);
  EXPECT_EQ(p2.predicted.activationCopyUs, 12.5);
  EXPECT_EQ(writePlan(p2), writePlan(plan));
  // The copy bound is written with its parts, only where the planner set it.
  EXPECT_EQ(writePlan(plan).find("copy_bound_us"), std::string::npos);
  plan.predicted.copyInUs = 40.5;
  plan.predicted.copyOutUs = 20.25;
  plan.predicted.unconstrainedStepUs = 30;
  plan.predicted.copyBoundUs = 40.5;
  Plan p3;
  ASSERT_TRUE(validatePlan(parseJson(writePlan(plan), "plan"), p3).empty());
  EXPECT_EQ(p3.predicted.copyInUs, 40.5);
  EXPECT_EQ(p3.predicted.copyOutUs, 20.25);
  EXPECT_EQ(p3.predicted.unconstrainedStepUs, 30);
  EXPECT_EQ(p3.predicted.copyBoundUs, 40.5);
}

TEST(RoundTrip, AnOptimizersImplementationAndGroupStayAbsentOrPresent) {
  Trace trace = readTrace(kInputs / "minimal.trace.json");
  EXPECT_EQ(writeTrace(trace).find("optimizer_impl"), std::string::npos);
  trace.params[0].optimizerImpl = "foreach";
  Trace t2;
  ASSERT_TRUE(validateTrace(parseJson(writeTrace(trace), "trace"), t2).empty());
  EXPECT_EQ(t2.params[0].optimizerImpl, "foreach");
  EXPECT_FALSE(t2.params[1].optimizerImpl.has_value());
  EXPECT_EQ(writeTrace(trace).find("optimizer_group"), std::string::npos);
  trace.params[1].optimizerGroup = 3;
  ASSERT_TRUE(validateTrace(parseJson(writeTrace(trace), "trace"), t2).empty());
  EXPECT_EQ(t2.params[1].optimizerGroup, 3);
  EXPECT_FALSE(t2.params[0].optimizerGroup.has_value());
  trace.params[0].optimizerImpl = "vectorized";
  const auto diags = validateTrace(parseJson(writeTrace(trace), "trace"), t2);
  ASSERT_FALSE(diags.empty());
  EXPECT_EQ(diags[0].pointer, "/params/0/optimizer_impl");
}

TEST(Signature, DependsOnNamesShapesDtypesAndWorldSizeOnly) {
  std::vector<TraceParam> params{{0, "a.weight", {4, 3}, "float32", 12, 6, true, std::nullopt},
                                 {1, "a.bias", {3}, "float32", 3, 2, true, std::nullopt}};
  const std::string base = paramSignature(params, 2);
  EXPECT_EQ(base, "fnv1a64:" + base.substr(8));
  EXPECT_EQ(base.size(), 8u + 16u);
  // Order of the table does not matter; ids do.
  std::vector<TraceParam> reversed{params[1], params[0]};
  EXPECT_EQ(paramSignature(reversed, 2), base);
  EXPECT_NE(paramSignature(params, 4), base);
  auto renamed = params;
  renamed[0].name = "b.weight";
  EXPECT_NE(paramSignature(renamed, 2), base);
  auto reshaped = params;
  reshaped[0].shape = {3, 4};
  EXPECT_NE(paramSignature(reshaped, 2), base);
  auto retyped = params;
  retyped[1].dtype = "bfloat16";
  EXPECT_NE(paramSignature(retyped, 2), base);
  auto frozen = params;
  frozen[1].requiresGrad = false;
  EXPECT_EQ(paramSignature(frozen, 2), base);
}

TEST(Signature, MatchesTheDocumentedByteString) {
  // docs/formats.md: "<id>\t<name>\t<dims joined by x>\t<dtype>\n" per parameter by id,
  // then "world_size\t<N>\n", hashed with FNV-1a 64. Python computes the same value.
  std::vector<TraceParam> params{{0, "w", {2, 3}, "float32", 6, 3, true, std::nullopt}};
  EXPECT_EQ(paramSignature(params, 2), "fnv1a64:f7984124c8ca94da");
}

TEST(Digest, ChangesWithAnyRecordedNumber) {
  Trace trace = readTrace(kInputs / "minimal.trace.json");
  const std::string digest = traceDigest(trace);
  EXPECT_EQ(traceDigest(trace), digest);
  trace.steps[0].graphs[0].events[1].endUs += 0.5;
  EXPECT_NE(traceDigest(trace), digest);
}

TEST(AtomicWrite, ReplacesTheFileAndLeavesNoTemporary) {
  const auto dir = std::filesystem::temp_directory_path() / ("dcplan-atomic-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto path = dir / "out.json";
  writeFileAtomically(path, "first\n");
  writeFileAtomically(path, "second\n");
  EXPECT_EQ(readText(path), "second\n");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator()),
            1);
  std::filesystem::remove_all(dir);
}

TEST(AtomicWrite, FailureNamesTheFileAndLeavesNothing) {
  const auto path = std::filesystem::path("/nonexistent-dir-dcplan/out.json");
  try {
    writeFileAtomically(path, "x");
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "/nonexistent-dir-dcplan/out.json: cannot write: No such file or directory");
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

}  // namespace
}  // namespace dcplan::schemas
