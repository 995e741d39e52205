// dcplan-gen-trace: writes a synthetic trace of a Llama-style model, for planner
// development before (or without) a recorded one.
#include <exception>
#include <iostream>

#include <CLI/CLI.hpp>

#include "dcplan/schemas/io.h"
#include "dcplan/testing/trace_generator.h"

int main(int argc, char** argv) {
  dcplan::testing::GeneratorOptions o;
  std::string output;
  CLI::App app{"Write a synthetic dcplan trace of a Llama-style model", "dcplan-gen-trace"};
  app.add_option("-o,--output", output, "trace file to write")->required();
  app.add_option("--layers", o.model.layers, "transformer blocks")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--hidden", o.model.hidden, "hidden size")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--ffn", o.model.ffn, "MLP size (0: 8/3 hidden)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--heads", o.model.heads, "attention heads")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--kv-heads", o.model.kvHeads, "key/value heads (0: heads)")->capture_default_str();
  app.add_option("--vocab", o.model.vocab, "vocabulary size")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--tied", o.model.tiedEmbedding, "tie the output head to the embedding");
  app.add_option("--tokens", o.model.tokensPerRank, "tokens per rank per step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--world-size", o.worldSize, "ranks")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--stage", o.stage, "ZeRO stage")->check(CLI::Range(1, 3))->capture_default_str();
  app.add_option("--steps", o.steps, "optimizer steps")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--grad-accum", o.gradAccumSteps, "micro-steps per optimizer step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--param-dtype", o.paramDtype, "gather dtype")->capture_default_str();
  app.add_option("--reduce-dtype", o.reduceDtype, "reduce dtype")->capture_default_str();
  app.add_option("--device", o.cluster.device, "device name (\"cpu\" gives a Gloo trace)")
      ->capture_default_str();
  app.add_option("--tflops", o.cluster.computeTflops, "achieved compute rate")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--bus-gbps", o.cluster.peakBusGBps, "peak bus bandwidth of large collectives")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--latency-us", o.cluster.latencyUs, "per-collective latency")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--capacity", o.cluster.capacityBytes, "device memory in bytes")->capture_default_str();
  app.add_option("--seed", o.seed, "timing jitter seed")->capture_default_str();
  app.add_option("--jitter", o.jitter, "relative timing jitter")
      ->check(CLI::Range(0.0, 0.5))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    dcplan::schemas::writeFileAtomically(output,
                                         dcplan::schemas::writeTrace(dcplan::testing::generateTrace(o)));
  } catch (const std::exception& e) {
    std::cerr << "dcplan-gen-trace: error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
