// Each kind of bad document gives its exact diagnostic; reading reports the file.
#include <functional>
#include <map>
#include <set>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "dcplan/schemas/io.h"
#include "dcplan/schemas/network.h"

namespace dcplan::schemas {
namespace {

using nlohmann::ordered_json;

const std::string kInputs = std::string(DCPLAN_SOURCE_DIR) + "/tests/lit/Inputs/";

ordered_json minimalTrace() { return readJsonFile(kInputs + "minimal.trace.json"); }
ordered_json minimalPlan() { return readJsonFile(kInputs + "minimal.plan.json"); }

std::vector<std::string> traceProblems(const ordered_json& doc) {
  Trace trace;
  std::vector<std::string> out;
  for (const auto& d : validateTrace(doc, trace)) out.push_back(d.str());
  return out;
}

std::vector<std::string> planProblems(const ordered_json& doc) {
  Plan plan;
  std::vector<std::string> out;
  for (const auto& d : validatePlan(doc, plan)) out.push_back(d.str());
  return out;
}

struct TraceCase {
  const char* name;
  std::function<void(ordered_json&)> breakIt;
  std::vector<std::string> expected;
};

// The case's name in test listings and ctest's names, not its bytes (which hold addresses).
void PrintTo(const TraceCase& c, std::ostream* os) { *os << c.name; }

ordered_json& event(ordered_json& t, int graph, int index) {
  return t["steps"][0]["graphs"][graph]["events"][index];
}

class BrokenTrace : public ::testing::TestWithParam<TraceCase> {};

TEST_P(BrokenTrace, GivesItsExactDiagnostic) {
  ordered_json doc = minimalTrace();
  GetParam().breakIt(doc);
  EXPECT_EQ(traceProblems(doc), GetParam().expected);
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, BrokenTrace,
    ::testing::Values(
        TraceCase{"MissingMeta", [](auto& t) { t.erase("meta"); }, {"missing required field \"meta\""}},
        TraceCase{"StringWorldSize",
                  [](auto& t) { t["meta"]["world_size"] = "2"; },
                  {"/meta/world_size: expected an integer, got string \"2\""}},
        TraceCase{"FloatWorldSize",
                  [](auto& t) { t["meta"]["world_size"] = 2.5; },
                  {"/meta/world_size: expected an integer, got number 2.5"}},
        TraceCase{"HugeBytes",
                  [](auto& t) { event(t, 0, 0)["bytes"] = 18446744073709551615ull; },
                  {"/steps/0/graphs/0/events/0/bytes: integer 18446744073709551615 is out of range"}},
        TraceCase{"UnknownBackend",
                  [](auto& t) { t["meta"]["backend"] = "mpi"; },
                  {"/meta/backend: expected one of \"nccl\", \"gloo\", got \"mpi\""}},
        TraceCase{"VersionNotString",
                  [](auto& t) { t["meta"]["versions"]["torch"] = 2; },
                  {"/meta/versions/torch: expected a version string, got integer 2"}},
        TraceCase{"NegativeNumel",
                  [](auto& t) { t["params"][1]["numel"] = -3; },
                  {"/params/1/numel: expected an integer >= 0, got -3"}},
        TraceCase{"EmptyName",
                  [](auto& t) { t["params"][0]["name"] = ""; },
                  {"/params/0/name: expected a non-empty name"}},
        TraceCase{"DuplicateName",
                  [](auto& t) { t["params"][1]["name"] = "fc.weight"; },
                  {"/params/1/name: duplicate parameter name \"fc.weight\" (first at /params/0)"}},
        TraceCase{"ShapeNotArray",
                  [](auto& t) { t["params"][0]["shape"] = 12; },
                  {"/params/0/shape: expected an array, got integer 12"}},
        TraceCase{"DanglingFusedId",
                  [](auto& t) {
                    auto& e = event(t, 0, 0);
                    e["op"] = "prefetch_params_fused";
                    e.erase("ds_id");
                    e["ds_ids"] = {0, 9};
                  },
                  {"/steps/0/graphs/0/events/0/ds_ids/1: ds_id 9 is not in the parameter table (/params)"}},
        TraceCase{"ReleaseWithoutUsers",
                  [](auto& t) { event(t, 0, 2).erase("n_users"); },
                  {"/steps/0/graphs/0/events/2: missing required field \"n_users\""}},
        TraceCase{"IdOnEndBackward",
                  [](auto& t) { event(t, 1, 5)["ds_id"] = 0; },
                  {"/steps/0/graphs/1/events/5/ds_id: unknown field \"ds_id\""}},
        TraceCase{
            "UnknownStream",
            [](auto& t) { event(t, 0, 0)["stream"] = "nccl"; },
            {"/steps/0/graphs/0/events/0/stream: expected one of \"compute\", \"allgather\", \"reduce\", "
             "\"copy\", \"offload\", \"reload\", got \"nccl\""}},
        TraceCase{"DuplicateGraphId",
                  [](auto& t) { t["steps"][0]["graphs"][1]["id"] = 0; },
                  {"/steps/0/graphs/1/id: duplicate graph id 0 in this step"}},
        TraceCase{"StepIndexRepeats",
                  [](auto& t) { t["steps"].push_back(t["steps"][0]); },
                  {"/steps/1/index: step indices must increase: 0 follows 0"}},
        TraceCase{"NegativeTime",
                  [](auto& t) { event(t, 0, 1)["compute_us"] = -1.0; },
                  {"/steps/0/graphs/0/events/1/compute_us: expected a number >= 0.0, got -1.0"}},
        TraceCase{
            "PeakBelowMemoryInUse",
            [](auto& t) {
              event(t, 0, 1)["memory_bytes"] = 5000;
              event(t, 0, 1)["peak_bytes"] = 4000;
            },
            {"/steps/0/graphs/0/events/1/peak_bytes: peak_bytes (4000) is below memory_bytes (5000): the "
             "peak since the previous op includes the bytes in use at this one"}},
        TraceCase{"NegativeHostTime",
                  [](auto& t) { event(t, 0, 1)["host_us"] = -2.0; },
                  {"/steps/0/graphs/0/events/1/host_us: expected a number >= 0.0, got -2.0"}},
        TraceCase{"IssueTimeNotANumber",
                  [](auto& t) { event(t, 1, 0)["issue_us"] = "fast"; },
                  {"/steps/0/graphs/1/events/0/issue_us: expected a number, got string \"fast\""}},
        TraceCase{"NegativeOptimizerHostTime",
                  [](auto& t) { t["steps"][0]["optimizer_host_us"] = -1; },
                  {"/steps/0/optimizer_host_us: expected a number >= 0.0, got -1"}},
        TraceCase{"UnknownReplayMode",
                  [](auto& t) { t["meta"]["replay"] = "jit"; },
                  {"/meta/replay: expected one of \"eager\", \"compiled\", got \"jit\""}},
        TraceCase{"InputShapeNotAShape",
                  [](auto& t) { t["steps"][0]["graphs"][0]["input_shapes"] = {{2, 6}, 3}; },
                  {"/steps/0/graphs/0/input_shapes/1: expected a shape (an array of integers >= 0), got "
                   "integer 3"}},
        TraceCase{"NegativeInputDim",
                  [](auto& t) { t["steps"][0]["graphs"][0]["input_shapes"] = {{2, -6}}; },
                  {"/steps/0/graphs/0/input_shapes/0/1: expected an integer >= 0, got -6"}},
        TraceCase{"InputShapesOnABackward",
                  [](auto& t) { t["steps"][0]["graphs"][1]["input_shapes"] = {{2, 6}}; },
                  {"/steps/0/graphs/1/input_shapes: input shapes belong to forward graphs; this graph is a "
                   "backward"}},
        TraceCase{
            "SavedActivationsOnABackward",
            [](auto& t) {
              t["steps"][0]["graphs"][1]["saved_activations"] = {{{"packs", {0}}, {"bytes", 4}, {"seq", 0}}};
            },
            {"/steps/0/graphs/1/saved_activations: saved activations belong to forward graphs; this graph "
             "is a backward"}},
        TraceCase{
            "SavesOutOfOrder",
            [](auto& t) {
              t["steps"][0]["graphs"][0]["saved_activations"] = {
                  {{"packs", {0, 3}}, {"bytes", 4}, {"seq", 0}},
                  {{"packs", {2, 1}}, {"bytes", 4}, {"seq", 1}}};
            },
            {"/steps/0/graphs/0/saved_activations/1/packs/1: expected the saves in increasing order, got 1 "
             "after 2"}},
        TraceCase{
            "ASaveInTwoActivations",
            [](auto& t) {
              t["steps"][0]["graphs"][0]["saved_activations"] = {
                  {{"packs", {0, 2}}, {"bytes", 4}, {"seq", 0}}, {{"packs", {2}}, {"bytes", 4}, {"seq", 1}}};
            },
            {"/steps/0/graphs/0/saved_activations/1/packs/0: save 2 belongs to an earlier saved activation "
             "too"}},
        TraceCase{
            "ActivationsNotInTheOrderFirstSaved",
            [](auto& t) {
              t["steps"][0]["graphs"][0]["saved_activations"] = {{{"packs", {1}}, {"bytes", 4}, {"seq", 0}},
                                                                 {{"packs", {0}}, {"bytes", 4}, {"seq", 1}}};
            },
            {"/steps/0/graphs/0/saved_activations/1/packs/0: expected the activations in the order first "
             "saved: 0 after 1"}},
        TraceCase{
            "SavedPastTheForward",
            [](auto& t) {
              t["steps"][0]["graphs"][0]["saved_activations"] = {{{"packs", {0}}, {"bytes", 4}, {"seq", 4}}};
            },
            {"/steps/0/graphs/0/saved_activations/0/seq: expected an op of this forward from 0 to 3 (its "
             "end), got 4"}},
        TraceCase{"FreedBeforeSaved",
                  [](auto& t) {
                    t["steps"][0]["graphs"][0]["saved_activations"] = {
                        {{"packs", {0}}, {"bytes", 4}, {"seq", 2}, {"freed_at", 1}}};
                  },
                  {"/steps/0/graphs/0/saved_activations/0/freed_at: expected an op of this forward from 2 to "
                   "3 (its "
                   "end), got 1"}},
        TraceCase{"ASavedActivationWithoutSavesOrBytes",
                  [](auto& t) {
                    t["steps"][0]["graphs"][0]["saved_activations"] = {
                        {{"packs", ordered_json::array()}, {"bytes", 0}, {"seq", 0}}};
                  },
                  {"/steps/0/graphs/0/saved_activations/0/packs: expected at least one save",
                   "/steps/0/graphs/0/saved_activations/0/bytes: expected the storage's size, > 0"}},
        TraceCase{"EmptyCurve",
                  [](auto& t) { t["calibration"]["all_reduce"] = ordered_json::array(); },
                  {"/calibration/all_reduce: expected at least one calibration point"}},
        TraceCase{"ZeroCopyRate",
                  [](auto& t) { t["calibration"]["h2d_gbps"] = 0; },
                  {"/calibration/h2d_gbps: expected a number > 0, got 0.0"}},
        TraceCase{"TwoProblems",
                  [](auto& t) {
                    t["meta"]["stage"] = 0;
                    t["memory"]["capacity_bytes"] = "lots";
                  },
                  {"/meta/stage: expected an integer >= 1, got 0",
                   "/memory/capacity_bytes: expected an integer, got string \"lots\""}}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(Validate, MinimalDocumentsAreValid) {
  EXPECT_TRUE(traceProblems(minimalTrace()).empty());
  EXPECT_TRUE(planProblems(minimalPlan()).empty());
}

TEST(Validate, ModelIsLeftUntouchedWhenInvalid) {
  ordered_json doc = minimalTrace();
  doc["params"][0]["numel"] = 5;
  Trace trace;
  trace.meta.device = "untouched";
  EXPECT_FALSE(validateTrace(doc, trace).empty());
  EXPECT_EQ(trace.meta.device, "untouched");
}

TEST(Validate, PlanProblems) {
  ordered_json plan = minimalPlan();
  plan["graphs"][0]["prefetch"].push_back({{"position", 0}, {"ds_ids", ordered_json::array()}});
  plan["graphs"][1]["prefetch"][0]["ds_ids"] = {0, 0};
  plan["graphs"][1]["id"] = 0;
  plan["predicted"].erase("peak_memory_bytes");
  EXPECT_EQ(planProblems(plan), (std::vector<std::string>{
                                    "/graphs/0/prefetch/1/ds_ids: expected at least one id",
                                    "/graphs/1/id: duplicate graph id 0",
                                    "/graphs/1/prefetch/0/ds_ids/1: duplicate id 0",
                                    "/predicted: missing required field \"peak_memory_bytes\"",
                                }));
}

TEST(Validate, AHostScaleIsAPositiveNumberOfAPlanForTheHost) {
  ordered_json plan = minimalPlan();
  plan["options"]["host_scale"] = 0.7;
  EXPECT_TRUE(planProblems(plan).empty());
  plan["options"]["host_scale"] = 0;
  EXPECT_EQ(planProblems(plan), (std::vector<std::string>{"/options/host_scale: expected a number > 0, got 0.0"}));
  plan["options"]["host_scale"] = 0.7;
  plan["options"]["cuda_graph"] = true;
  EXPECT_EQ(planProblems(plan),
            (std::vector<std::string>{"/options/host_scale: a plan for a CUDA graph (cuda_graph) is made from the "
                                      "device's own times, with no host time to scale: expected no host_scale"}));
}

TEST(Validate, OffloadedSavesProblems) {
  ordered_json plan = minimalPlan();
  plan["graphs"][0]["offload_saves"] = {{{"pack", 3}, {"bytes", 64}}, {{"pack", 3}, {"bytes", 0}}};
  plan["graphs"][1]["offload_saves"] = {{{"pack", 0}, {"bytes", 64}}};
  EXPECT_EQ(planProblems(plan), (std::vector<std::string>{
                                    "/graphs/0/offload_saves/1/pack: expected the saves in increasing order, got 3 "
                                    "after 3",
                                    "/graphs/0/offload_saves/1/bytes: expected the storage's size, > 0",
                                    "/graphs/1/offload_saves: offloaded saves belong to forward graphs; this graph "
                                    "is a backward",
                                }));
}

TEST(Validate, PersistentEndsProblems) {
  ordered_json plan = minimalPlan();
  plan["persistent"] = {1};
  plan["graphs"][1]["persistent_ends"] = {{{"position", 4}, {"ds_id", 1}}};
  EXPECT_TRUE(planProblems(plan).empty());
  plan["graphs"][1]["persistent_ends"] = {{{"position", 4}, {"ds_id", 1}}, {{"position", 4}, {"ds_id", 0}}};
  plan["graphs"][0]["persistent_ends"] = {{{"position", 2}, {"ds_id", 1}}};
  EXPECT_EQ(planProblems(plan), (std::vector<std::string>{
                                    "/graphs/0/persistent_ends: persistent copies end in backward graphs; this graph "
                                    "is a forward",
                                    "/graphs/1/persistent_ends/1/position: expected the positions in increasing "
                                    "order, got 4 after 4",
                                    "/graphs/1/persistent_ends/1/ds_id: expected a ds_id of /persistent (a "
                                    "persistent parameter), got 0",
                                }));
}

TEST(Validate, NetworkProblems) {
  const ordered_json good = {{"schema", "dcplan.network/v1"},
                             {"created_by", "test"},
                             {"world_size", 2},
                             {"backend", "gloo"},
                             {"device", "cpu"},
                             {"calibration",
                              {{"all_gather", {{{"bytes", 1024}, {"us", 20.0}}}},
                               {"reduce_scatter", {{{"bytes", 1024}, {"us", 22.0}}}},
                               {"all_reduce", {{{"bytes", 1024}, {"us", 30.0}}}}}}};
  Network n;
  EXPECT_TRUE(validateNetwork(good, n).empty());
  ordered_json bad = good;
  bad["world_size"] = 1;  // one rank has no collectives
  bad["backend"] = "mpi";
  bad["calibration"]["all_gather"].push_back({{"bytes", 512}, {"us", 30.0}});
  bad["extra"] = true;
  std::vector<std::string> problems;
  for (const auto& d : validateNetwork(bad, n)) problems.push_back(d.str());
  EXPECT_EQ(problems,
            (std::vector<std::string>{
                "/world_size: expected an integer >= 2, got 1",
                "/backend: expected one of \"gloo\", \"nccl\", got \"mpi\"",
                "/calibration/all_gather/1/bytes: calibration sizes must increase: 512 follows 1024",
                "/extra: unknown field \"extra\"",
            }));
  // A plan's copy of it holds the same rules.
  ordered_json plan = minimalPlan();
  plan["options"]["network"] = good;
  plan["options"]["network"].erase("schema");
  plan["options"]["network"].erase("created_by");
  EXPECT_EQ(planProblems(plan),
            (std::vector<std::string>{"/options/network: missing required field \"file\""}));
}

TEST(Validate, OffloadGroupsHoldEachParameterOnce) {
  ordered_json plan = minimalPlan();
  plan["offload"] = {{"optimizer_state", {{{"ds_ids", {0}}, {"bytes", 8}}, {{"ds_ids", {1, 0}}, {"bytes", -1}}}}};
  EXPECT_EQ(planProblems(plan), (std::vector<std::string>{
                                    "/offload/optimizer_state/1/ds_ids/1: id 0 is already in group 0",
                                    "/offload/optimizer_state/1/bytes: expected an integer >= 0, got -1",
                                }));
  plan["offload"] = {{"optimizer_state", ordered_json::array()}};
  EXPECT_EQ(planProblems(plan),
            std::vector<std::string>{"/offload/optimizer_state: expected at least one group"});
  plan["offload"] = {{"optimizer_state", {{{"ds_ids", {0}}, {"bytes", 8}}}}, {"master", true}};
  EXPECT_EQ(planProblems(plan).size(), 1u);  // an unknown field, named
  plan["offload"] = {{"optimizer_state", {{{"ds_ids", {0}}, {"bytes", 8}, {"master_bytes", 0}}}}};
  EXPECT_EQ(
      planProblems(plan),
      std::vector<std::string>{
          "/offload/optimizer_state/0/master_bytes: expected an integer >= 1 (absent: kept on the device)"});
}

TEST(Validate, PrefetchPositionsMustNotDecrease) {
  ordered_json plan = minimalPlan();
  plan["graphs"][0]["prefetch"] = {{{"position", 4}, {"ds_ids", {0}}}, {{"position", 2}, {"ds_ids", {1}}}};
  EXPECT_EQ(
      planProblems(plan),
      std::vector<std::string>{"/graphs/0/prefetch/1/position: positions must not decrease: 2 follows 4"});
}

TEST(Validate, GuardPeaksAreBytesOnePerPersistentId) {
  ordered_json plan = minimalPlan();
  ordered_json peaks = ordered_json::array();
  for (size_t i = 0; i < plan["persistent"].size(); ++i) peaks.push_back(4096);
  plan["guard"] = {{"start_bytes", 1024}, {"persistent_peak_bytes", peaks}};
  plan["graphs"][0]["prefetch"][0]["peak_bytes"] = 0;
  EXPECT_TRUE(planProblems(plan).empty());
  plan["guard"]["persistent_peak_bytes"].push_back(1);
  plan["graphs"][0]["prefetch"][0]["peak_bytes"] = -1;
  EXPECT_EQ(planProblems(plan),
            (std::vector<std::string>{
                "/guard/persistent_peak_bytes: expected one entry per id of /persistent (" +
                    std::to_string(plan["persistent"].size()) + "), got " +
                    std::to_string(plan["persistent"].size() + 1),
                "/graphs/0/prefetch/0/peak_bytes: expected an integer >= 0, got -1",
            }));
}

TEST(Validate, PlanInputShapesAreShapesOfForwardGraphs) {
  ordered_json plan = minimalPlan();
  ASSERT_EQ(plan["graphs"][1]["kind"], "backward");
  plan["graphs"][0]["input_shapes"] = {{2, 6}, ordered_json::array()};  // a scalar tensor has shape ()
  EXPECT_TRUE(planProblems(plan).empty());
  plan["graphs"][0]["input_shapes"] = {{2, "6"}};
  plan["graphs"][1]["input_shapes"] = {{2, 6}};
  EXPECT_EQ(planProblems(plan),
            (std::vector<std::string>{
                "/graphs/0/input_shapes/0/1: expected an integer, got string \"6\"",
                "/graphs/1/input_shapes: input shapes belong to forward graphs; this graph is a backward",
            }));
}

TEST(Parse, RejectsDuplicateKeysWithTheirPointer) {
  try {
    parseJson(R"({"a": [1, {"b": 1, "c": {"d": 1, "d": 2}}]})", "dup.json");
    FAIL() << "expected an error";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()), "dup.json: /a/1/c/d: duplicate key \"d\"");
  }
}

TEST(Parse, EscapesPointerTokens) {
  try {
    parseJson(R"({"x/y": {"t~": 1, "t~": 2}})", "esc.json");
    FAIL() << "expected an error";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()), "esc.json: /x~1y/t~0: duplicate key \"t~\"");
  }
}

TEST(Parse, SyntaxErrorsNameLineAndColumn) {
  try {
    parseJson("{\n  \"a\": trux\n}", "bad.json");
    FAIL() << "expected an error";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("bad.json: not valid JSON: parse error at line 2, column", 0), 0u)
        << e.what();
  }
}

TEST(Parse, DeepNestingIsAnErrorNotACrash) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  // Either parsed (iteratively) or refused, never a stack overflow.
  try {
    auto doc = parseJson(deep, "deep.json");
    EXPECT_THROW(detectKind(doc, "deep.json"), InputError);
  } catch (const InputError&) {
  }
}

TEST(OpRoles, EachOpOfTheFormatHasItsRoleAndOnlyWaitsWaitForAnotherStream) {
  const std::map<std::string, OpRole> format = {
      {"allgather_param", OpRole::Gather},    {"prefetch_params_fused", OpRole::Prefetch},
      {"wait_allgather", OpRole::GatherWait}, {"release_param", OpRole::Release},
      {"reduce_grad", OpRole::ReduceGrad},    {"end_backward", OpRole::EndBackward},
      {"offload_tensor", OpRole::Offload},    {"offload_parameter", OpRole::Offload},
      {"reload_tensor", OpRole::Reload},      {"reload_parameter", OpRole::Reload},
      {"wait_offload", OpRole::CopyWait},     {"wait_reload", OpRole::CopyWait},
      {"free_tensors", OpRole::Free},
  };
  const std::set<std::string> waiting = {"wait_allgather", "wait_offload", "wait_reload", "end_backward"};
  for (const auto& [name, role] : format) {
    EXPECT_EQ(opRole(name), role) << name;
    EXPECT_EQ(waitsForAnotherStream(name), waiting.count(name) == 1) << name;
  }
  EXPECT_FALSE(opRole("allgather"));
  EXPECT_FALSE(waitsForAnotherStream("wait"));
}

TEST(Read, KindMismatchIsNamed) {
  try {
    readPlan(kInputs + "minimal.trace.json");
    FAIL() << "expected an error";
  } catch (const InputError& e) {
    EXPECT_EQ(
        std::string(e.what()),
        kInputs +
            "minimal.trace.json: /schema: expected a plan (\"dcplan.plan/v1\"), got \"dcplan.trace/v1\"");
  }
}

TEST(Read, InputErrorKeepsEveryDiagnostic) {
  ordered_json doc = minimalTrace();
  doc["meta"]["stage"] = 9;
  doc["meta"]["world_size"] = 0;
  Trace trace;
  InputError error("t.json", validateTrace(doc, trace));
  EXPECT_EQ(error.diagnostics().size(), 2u);
  EXPECT_EQ(std::string(error.what()), "t.json: /meta/world_size: expected an integer >= 1, got 0");
}

}  // namespace
}  // namespace dcplan::schemas
