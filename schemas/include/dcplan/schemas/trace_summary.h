// Aggregate facts of a trace: model size, op counts, bytes moved, time split.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dcplan/schemas/trace.h"

namespace dcplan::schemas {

struct GraphSummary {
  int64_t id = 0;
  GraphKind kind = GraphKind::Forward;
  int64_t ops = 0;
  int64_t gathers = 0;  ///< allgather_param, plus each id of prefetch_params_fused
  int64_t releases = 0;
  int64_t reduces = 0;
  uint64_t gatheredBytes = 0;
  uint64_t reducedBytes = 0;
  double computeUs = 0;        ///< sum of compute_us
  double exposedCommUs = 0;    ///< compute-stream time spent waiting (wait_*, end_backward)
  double allgatherBusyUs = 0;  ///< sum of all-gather durations
  double reduceBusyUs = 0;     ///< sum of reduce durations
};

struct SlowOp {
  int64_t step = 0;
  int64_t graph = 0;
  int64_t seq = 0;
  std::string op;
  std::string param;  ///< qualified name of its (first) parameter, or ""
  uint64_t bytes = 0;
  double us = 0;
};

struct TraceSummary {
  int64_t params = 0;
  int64_t trainableParams = 0;
  uint64_t elements = 0;
  uint64_t masterBytes = 0;      ///< elements x master dtype size
  uint64_t peakMemoryBytes = 0;  ///< highest memory_bytes or peak_bytes of any event
  int64_t steps = 0;
  std::vector<GraphSummary> graphs;  ///< per graph id, averaged over steps
  double computeUs = 0;              ///< per step
  double exposedCommUs = 0;          ///< per step
  double optimizerUs = 0;            ///< per optimizer step, averaged over the steps that ran it
  /// The host's side (every event has host_us and issue_us, every optimizer step
  /// optimizer_host_us): per step, like computeUs and optimizerUs.
  bool hostTimes = false;
  double hostComputeUs = 0;  ///< host_us: issuing the model's compute
  double issueUs = 0;        ///< issue_us: inside the dc ops
  double optimizerHostUs = 0;
  /// The device's own times (every event has device_us, every optimizer step
  /// optimizer_device_us): what a step replayed as one CUDA graph takes, per step.
  bool deviceTimes = false;
  double deviceComputeUs = 0;
  double deviceOpUs = 0;  ///< the ops' own device work (op_device_us), per step
  double optimizerDeviceUs = 0;
  std::vector<SlowOp> slowest;  ///< communication ops, longest first
  /// What the forwards saved for the backward (saved_activations), per step: tensors and bytes,
  /// and of those bytes the ones the recorder's trial saw leave the device by the forward's end
  /// once moved to the host (what offloading them frees at the backward's start).
  bool savedActivations = false;
  double savedTensors = 0;
  uint64_t savedBytes = 0;
  uint64_t savedFreedBytes = 0;
  bool savedTried = false;  ///< some saved activation has freed_at: a trial ran
};

/// Averages over the recorded steps; `slowest` keeps the `topOps` longest collectives.
TraceSummary summarizeTrace(const Trace& trace, size_t topOps = 5);

}  // namespace dcplan::schemas
