// Synthetic traces of transformer-shaped models, for planner development and tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dcplan/schemas/trace.h"

namespace dcplan::testing {

/// Llama-style decoder: embedding, per layer (attention norm, q/k/v/o, MLP norm,
/// gate/up/down), final norm and output head.
struct TransformerShape {
  int64_t layers = 4;
  int64_t hidden = 1024;
  int64_t ffn = 0;  ///< 0: 8/3 * hidden rounded up to a multiple of 256
  int64_t heads = 16;
  int64_t kvHeads = 0;  ///< 0: same as heads
  int64_t vocab = 32000;
  bool tiedEmbedding = false;
  int64_t tokensPerRank = 1024;  ///< batch x sequence on each rank
};

/// How fast the simulated cluster is.
struct ClusterProfile {
  std::string device = "NVIDIA H200";
  double computeTflops = 400;  ///< achieved bf16 matmul rate
  double latencyUs = 15;       ///< per-collective latency
  double peakBusGBps = 270;    ///< bus bandwidth of large messages
  double halfBusBytes = 16e6;  ///< message size at which half the peak is reached
  double h2dGBps = 50;
  uint64_t capacityBytes = 141ull << 30;
};

struct GeneratorOptions {
  TransformerShape model;
  ClusterProfile cluster;
  int64_t worldSize = 8;
  int64_t stage = 3;
  int64_t steps = 2;
  int64_t gradAccumSteps = 1;
  std::string paramDtype = "bfloat16";
  std::string reduceDtype = "float32";
  uint64_t seed = 1;     ///< drives the timing jitter
  double jitter = 0.02;  ///< relative jitter of compute and communication times
};

/// A complete, valid trace of an on-demand (gather-on-use) ZeRO run of `options.model`.
schemas::Trace generateTrace(const GeneratorOptions& options);

/// Bus-bandwidth model of `cluster`: time of a collective moving `bytes` (full size).
double collectiveUs(const ClusterProfile& cluster, int64_t worldSize, uint64_t bytes);

}  // namespace dcplan::testing
