// A two-parameter trace with round numbers, for exact simulator expectations.
#pragma once

#include <string>
#include <vector>

#include "dcplan/schemas/trace.h"

namespace dcplan::planner::test {

/// Sizes of the tiny trace: multiples of the CUDA caching allocator's 512-byte blocks, so that
/// what the memory model counts is these numbers exactly.
inline constexpr uint64_t kTinyBase = 1'000'000;  ///< baseline bytes
inline constexpr uint64_t kTinyParam = 102'400;   ///< a gathered parameter, and its gradient
inline constexpr uint64_t kTinyShard = 51'200;    ///< a shard of it (2 ranks)
inline constexpr double kTinyGatherUs = 112.4;    ///< one parameter's all-gather or reduce-scatter

/// Two parameters of 102,400 gathered bytes each (fp32) on 2 NCCL ranks; all-gather and
/// reduce-scatter take 10 us + 1 us per 1,000 bytes at the measured sizes.
/// Forward: gather 0, 500 us compute, release 0, gather 1, 500 us, release 1.
/// Backward: gather 1, 1000 us, reduce 1, release 1, gather 0, 1000 us, reduce 0,
/// release 0, end_backward. Optimizer 50 us. Memory recorded = baseline + gathered + the
/// gradients the runtime holds in its (default, 100 MB) bucket until end_backward flushes it.
inline schemas::Trace tinyTrace() {
  using schemas::OpEvent;
  schemas::Trace t;
  t.meta.createdBy = "test";
  t.meta.worldSize = 2;
  t.meta.backend = "nccl";
  t.meta.device = "test";
  t.meta.stage = 3;
  t.meta.gradAccumSteps = 1;
  t.meta.paramDtype = "float32";
  t.meta.reduceDtype = "float32";
  t.memory.capacityBytes = 1'000'000'000;
  t.memory.baselineBytes = kTinyBase;
  for (int64_t id : {0, 1}) {
    schemas::TraceParam p;
    p.id = id;
    p.name = "layer" + std::to_string(id) + ".weight";
    p.shape = {256, 100};
    p.dtype = "float32";
    p.numel = 25'600;
    p.shardNumel = 12'800;
    t.params.push_back(p);
  }
  for (uint64_t b : {10'240ull, 102'400ull, 1'024'000ull}) {
    double us = 10 + static_cast<double>(b) / 1000;
    t.calibration.allGather.push_back({b, us});
    t.calibration.reduceScatter.push_back({b, us});
    t.calibration.allReduce.push_back({b, 2 * us});
  }
  uint64_t base = t.memory.baselineBytes;
  auto ev = [](int64_t seq, std::string op, std::vector<int64_t> ids, double compute, uint64_t mem) {
    OpEvent e;
    e.seq = seq;
    e.op = std::move(op);
    e.dsIds = std::move(ids);
    e.bytes = e.dsIds.empty() ? 0 : kTinyParam;
    e.dtype = e.dsIds.empty() ? "" : "float32";
    e.stream = "compute";
    e.computeUs = compute;
    e.memoryBytes = mem;
    if (e.op == "release_param") e.nUsers = 1;
    return e;
  };
  schemas::TraceGraph fwd{0, schemas::GraphKind::Forward, {}};
  fwd.events = {ev(0, "allgather_param", {0}, 0, base),
                ev(1, "wait_allgather", {0}, 0, base + kTinyParam),
                ev(2, "release_param", {0}, 500, base + kTinyParam),
                ev(3, "allgather_param", {1}, 0, base),
                ev(4, "wait_allgather", {1}, 0, base + kTinyParam),
                ev(5, "release_param", {1}, 500, base + kTinyParam)};
  const uint64_t grad = kTinyParam;
  schemas::TraceGraph bwd{1, schemas::GraphKind::Backward, {}};
  bwd.events = {ev(0, "allgather_param", {1}, 0, base),
                ev(1, "wait_allgather", {1}, 0, base + kTinyParam),
                ev(2, "reduce_grad", {1}, 1000, base + kTinyParam + grad),
                ev(3, "release_param", {1}, 0, base + kTinyParam + grad),
                ev(4, "allgather_param", {0}, 0, base + grad),
                ev(5, "wait_allgather", {0}, 0, base + kTinyParam + grad),
                ev(6, "reduce_grad", {0}, 1000, base + kTinyParam + 2 * grad),
                ev(7, "release_param", {0}, 0, base + kTinyParam + 2 * grad),
                ev(8, "end_backward", {}, 0, base + 2 * grad)};
  double clock = 0;
  for (auto* g : {&fwd, &bwd}) {
    clock = 0;
    for (OpEvent& e : g->events) {
      clock += e.computeUs;
      e.startUs = clock;
      e.endUs = clock;
    }
  }
  schemas::TraceStep step;
  step.index = 0;
  step.graphs = {fwd, bwd};
  step.optimizerUs = 50;
  t.steps.push_back(step);
  return t;
}

/// AdamW's exp_avg and exp_avg_sq of a 51,200-byte shard.
inline constexpr uint64_t kTinyState = 2 * kTinyShard;

/// The tiny trace with what planned offload needs: each shard's optimizer state, and the host link
/// at 1 GB/s in (102,400 bytes in 102.4 us) and 0.5 GB/s out (in 204.8 us).
inline schemas::Trace offloadableTrace() {
  schemas::Trace t = tinyTrace();
  for (auto& p : t.params) p.optimizerStateBytes = kTinyState;
  t.calibration.h2dGBps = 1.0;
  t.calibration.d2hGBps = 0.5;
  return t;
}

}  // namespace dcplan::planner::test
