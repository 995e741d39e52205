// The C++ model of a dcplan plan (schema "dcplan.plan/v1").
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dcplan/schemas/trace.h"

namespace dcplan::schemas {

inline constexpr const char* kPlanSchema = "dcplan.plan/v1";

/// The runtime's reduce-bucket size, in bytes, where no plan sets the buckets (a trace is recorded
/// so): a bucket is flushed when the next gradient would take it past this. The planner's default
/// schedule assumes it; dcplan._C.DEFAULT_BUCKET_BYTES gives it to Python.
inline constexpr int64_t kDefaultBucketBytes = 100'000'000;

/// What the plan was made from; a runtime refuses a plan whose signature differs.
struct PlanSource {
  std::string trace;           ///< file name of the trace, informational
  std::string traceDigest;     ///< traceDigest() of the trace
  std::string paramSignature;  ///< paramSignature() for the planned world size
  int64_t worldSize = 1;       ///< planned world size
  int64_t stage = 3;
  std::string replay = "eager";  ///< the trace's meta.replay: "eager" or "compiled"
};

/// The network a plan was made for (dcplan plan --network).
struct PlanNetwork {
  std::string file;  ///< as given to --network
  Network measured;
};

/// The options the planner ran with.
struct PlanOptions {
  std::string strategy;                       ///< "default", "heuristic" or "optimized"
  std::optional<uint64_t> memoryBudgetBytes;  ///< absent: unconstrained
  std::optional<double> bandwidthGBps;        ///< what-if bus bandwidth; absent: as calibrated
  int64_t gradAccumSteps = 1;
  /// Planned and predicted for a step replayed as one CUDA graph (dcplan.graphed_step): the
  /// device's own times (device_us), no host lane, no host cost per collective.
  bool cudaGraph = false;
  /// A GPU's eager step planned with its device lane on the device's own times (device_us,
  /// op_device_us, optimizer_device_us) beside the host lane; false: on the recorded compute_us
  /// (CPU ranks, a trace without them, or a plan made before the field existed, 2026-11-29, even
  /// one planned on the device's times between 2026-11-28 and then), as `dcplan inspect
  /// --trace` then simulates it again.
  bool deviceTimes = false;
  /// The plan was made with every collective at this multiple of the trace's calibration: fitted to
  /// the recorded run (CPU ranks) or to a replay (dcplan plan --calibrate); absent: 1, or from an
  /// older dcplan (inspect fits it again) (docs/planning.md, "In situ").
  std::optional<double> inSituScale;
  /// The trace's host times (host_us, issue_us, optimizer_host_us; on CPU ranks, where the host
  /// computes, its compute too) at this multiple: fitted to a replay (dcplan plan --calibrate).
  std::optional<double> hostScale;
  /// A plan for a CUDA graph only: the trace's device times (device_us, op_device_us,
  /// optimizer_device_us; fitted to its captured step first, where it has calibration.graph_step_us)
  /// at this multiple, fitted to the graph replays of an earlier plan (dcplan plan --calibrate).
  std::optional<double> deviceScale;
  /// Planned with the collectives of a network measurement instead of the trace's calibration
  /// (dcplan plan --network): what the plan is simulated with, whoever simulates it again.
  std::optional<PlanNetwork> network;
};

/// Gathers launched together (one prefetch_params_fused) before the op at `position`.
struct PrefetchGroup {
  PrefetchGroup() = default;
  PrefetchGroup(int64_t position, std::vector<int64_t> dsIds,
                std::optional<uint64_t> peakBytes = std::nullopt)
      : position(position), dsIds(std::move(dsIds)), peakBytes(peakBytes) {}

  int64_t position = 0;
  std::vector<int64_t> dsIds;
  /// Plans made under a memory budget: the most memory the simulation holds from the group's
  /// launch until its last member is gathered by its own op (over the graph's runs in a step). The
  /// runtime's budget guard holds the group back where this plus the memory the run holds beyond
  /// the plan's model would cross the budget.
  std::optional<uint64_t> peakBytes;
};

/// Gradients reduced together, in gradient-ready order.
struct PlanBucket {
  std::vector<int64_t> dsIds;
  uint64_t bytes = 0;
  std::string dtype;
};

/// A saved activation of a forward graph kept in host memory from its save until the backward
/// reads it (planned activation offload, docs/planning.md): the trace's saved_activations entry
/// whose first save is `pack`.
struct OffloadedSave {
  int64_t pack = 0;
  uint64_t bytes = 0;  ///< its storage's size: the runtime checks the save it offloads against it
};

/// A persistent copy's end: the release_param at `position` of parameter dsId.
struct PersistentEnd {
  int64_t position = 0;
  int64_t dsId = 0;
  bool operator==(const PersistentEnd& o) const { return position == o.position && dsId == o.dsId; }
};

struct PlanGraph {
  int64_t id = 0;
  GraphKind kind = GraphKind::Forward;
  std::vector<PrefetchGroup> prefetch;
  std::vector<PlanBucket> buckets;
  /// Forward graphs: the inputs of the recorded step the plan was made from (its memory and times
  /// hold for these); a replay whose inputs differ warns once. Absent: the trace did not record them.
  std::optional<InputShapes> inputShapes;
  /// Forward graphs: the saved activations each run of it moves to the host (ascending packs).
  std::vector<OffloadedSave> offloadSaves;
  /// Backward graphs (ZeRO-3): where a persistent copy of a trainable parameter ends in a backward
  /// before an optimizer step, which makes it stale: its last release_param in the graph
  /// (ascending positions). Absent from plans made before the field existed (2026-11-29): the
  /// runtime then keeps a compiled backward's copies to its end, and the hooks drop them at their
  /// last unpack.
  std::vector<PersistentEnd> persistentEnds;
};

/// Parameters whose optimizer state lives in host memory between optimizer steps (planned
/// offload): the optimizer steps the other parameters first, then these group by group, each
/// group's state copied back before its update and out again after it (docs/planning.md, "Offload").
struct OffloadGroup {
  std::vector<int64_t> dsIds;
  uint64_t bytes = 0;  ///< the group's optimizer state at the planned world size
  /// ZeRO-3: the group's fp32 master shards live on the host too, brought back for each gather
  /// of one of them and for the group's update, and dropped again after (docs/planning.md).
  uint64_t masterBytes = 0;  ///< their bytes at the planned world size; 0: kept on the device
};

/// Simulated outcome of a schedule.
struct Prediction {
  double stepUs = 0;
  double exposedCommUs = 0;
  uint64_t peakMemoryBytes = 0;
  /// Planned offload only (absent from the plan file without one): the optimizer state and master
  /// shards kept on the host, the copies' time per step each way (host to device, device to
  /// host), and how much of the step the copies lengthen it by (the rest runs beside the
  /// optimizer's updates).
  uint64_t offloadBytes = 0;
  double reloadUs = 0;
  double offloadUs = 0;
  double exposedCopyUs = 0;
  /// Planned activation offload only: the saved activations moved to the host in a step, and the
  /// copies' time both ways (on the compute stream: all of it lengthens the step).
  uint64_t activationOffloadBytes = 0;
  double activationCopyUs = 0;
  /// Planned offload of any class (absent without one): every copy's time per step each way (in:
  /// reload_us and the saved activations' copies back; out: offload_us and theirs out), the step the
  /// same trace is planned for without a memory budget (0: no plan fits the device without offload),
  /// and the bound the plan's step is held against: the largest of the three (the host link's
  /// busier direction, or the step that moves nothing).
  double copyInUs = 0;
  double copyOutUs = 0;
  double unconstrainedStepUs = 0;
  double copyBoundUs = 0;
};

struct Plan {
  std::string createdBy;  ///< "dcplan 0.1.0"
  PlanSource source;
  PlanOptions options;
  std::vector<int64_t> persistent;  ///< ds_ids kept gathered, ascending
  /// Plans made under a memory budget: what the runtime's budget guard reads (docs/replay.md).
  struct Guard {
    /// The memory the simulation holds as the step's first op is entered: what the runtime
    /// compares with what it measures there to find what the run holds beyond the plan's model.
    uint64_t startBytes = 0;
    /// ZeRO-3, one per id of `persistent`: the most memory the simulation holds from one of its
    /// releases until it is gathered again in the step (over its releases); 0 where it is not.
    std::vector<uint64_t> persistentPeakBytes;
  };
  std::optional<Guard> guard;
  std::vector<PlanGraph> graphs;
  std::vector<OffloadGroup> optimizerOffload;  ///< in stepping order; empty: no offload
  Prediction predicted;                        ///< this plan
  Prediction predictedDefault;                 ///< the default schedule on the same trace
};

}  // namespace dcplan::schemas
