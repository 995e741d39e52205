// The synthetic traces are valid, deterministic and shaped like the model asked for.
#include <map>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "dcplan/schemas/io.h"
#include "dcplan/testing/trace_generator.h"

namespace dcplan::testing {
namespace {

GeneratorOptions small() {
  GeneratorOptions o;
  o.model.layers = 3;
  o.model.hidden = 128;
  o.model.heads = 4;
  o.model.vocab = 500;
  o.worldSize = 4;
  return o;
}

TEST(Generator, ParameterTableOfALlamaModel) {
  auto t = generateTrace(small());
  // embedding + 9 per layer + final norm + head
  EXPECT_EQ(t.params.size(), 1u + 9u * 3u + 2u);
  EXPECT_EQ(t.params.front().name, "embed.weight");
  EXPECT_EQ(t.params.back().name, "head.weight");
  for (const auto& p : t.params) EXPECT_EQ(p.shardNumel, (p.numel + 3) / 4) << p.name;
}

TEST(Generator, TiedEmbeddingHasNoHeadAndReducesOnce) {
  auto o = small();
  o.model.tiedEmbedding = true;
  auto t = generateTrace(o);
  EXPECT_EQ(t.params.back().name, "norm.weight");
  std::map<int64_t, int> reduces;
  for (const auto& e : t.steps[0].graphs[1].events) {
    if (e.op == "reduce_grad") ++reduces[e.dsIds[0]];
  }
  EXPECT_EQ(reduces.size(), t.params.size());
  for (const auto& [id, n] : reduces) EXPECT_EQ(n, 1) << id;
}

TEST(Generator, DeterministicForASeedAndDifferentAcrossSeeds) {
  auto o = small();
  const std::string a = schemas::writeTrace(generateTrace(o));
  EXPECT_EQ(schemas::writeTrace(generateTrace(o)), a);
  o.seed = 99;
  EXPECT_NE(schemas::writeTrace(generateTrace(o)), a);
}

TEST(Generator, GradientAccumulationRunsTheOptimizerAtTheBoundaryOnly) {
  auto o = small();
  o.steps = 2;
  o.gradAccumSteps = 3;
  auto t = generateTrace(o);
  ASSERT_EQ(t.steps.size(), 6u);
  for (size_t s = 0; s < t.steps.size(); ++s) EXPECT_EQ(t.steps[s].optimizerUs > 0, s % 3 == 2) << s;
}

TEST(Generator, EveryGeneratedTraceValidates) {
  for (int64_t layers : {1, 4}) {
    for (int64_t ws : {1, 2, 5, 16}) {
      auto o = small();
      o.model.layers = layers;
      o.worldSize = ws;
      schemas::Trace parsed;
      auto diags =
          schemas::validateTrace(schemas::parseJson(schemas::writeTrace(generateTrace(o)), "gen"), parsed);
      EXPECT_TRUE(diags.empty()) << layers << " layers, " << ws << " ranks: " << diags.front().str();
    }
  }
}

TEST(Generator, BusBandwidthModelSaturates) {
  ClusterProfile c;
  const double small = collectiveUs(c, 2, 1 << 20);
  const double large = collectiveUs(c, 2, 1ull << 30);
  EXPECT_GT(large, small);
  // Large messages approach the peak bus bandwidth: (B/2) / t close to 270 GB/s.
  const double busGBps = (static_cast<double>(1ull << 30) / 2) / (large * 1e3);
  EXPECT_GT(busGBps, 250);
  EXPECT_LT(busGBps, 270);
}

}  // namespace
}  // namespace dcplan::testing
