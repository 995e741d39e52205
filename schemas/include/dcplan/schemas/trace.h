// The C++ model of a dcplan trace (schema "dcplan.trace/v1").
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dcplan::schemas {

inline constexpr const char* kTraceSchema = "dcplan.trace/v1";

/// Who recorded the trace and on what cluster.
struct TraceMeta {
  std::string createdBy;  ///< "dcplan-recorder 0.1.0", "dcplan-gen-trace 0.1.0", ...
  int64_t worldSize = 1;
  std::string backend;                          ///< "nccl" or "gloo"
  std::string device;                           ///< device name, e.g. "NVIDIA H200" or "cpu"
  int64_t stage = 3;                            ///< ZeRO stage the run used (1, 2 or 3)
  int64_t gradAccumSteps = 1;                   ///< micro-steps per optimizer step
  std::string paramDtype;                       ///< dtype parameters are gathered in
  std::string reduceDtype;                      ///< dtype gradients are reduced in
  std::map<std::string, std::string> versions;  ///< "dcplan", "torch", "nccl", ...
  /// How the recorded run replayed: "eager" (module hooks) or "compiled" (torch.compile graphs,
  /// dcplan.shard(compile=True)); the two issue different op sequences.
  std::string replay = "eager";
  /// The recorded script ran its step through dcplan.graphed_step (recorded uncaptured): its plan
  /// is for one CUDA graph per step (dcplan plan plans so by itself).
  bool graphed = false;
  /// A replay of this job checks each collective with the ranks first (DCPLAN_CHECK_COLLECTIVES, on by
  /// default on CPU ranks: one more small all-gather per collective, docs/runtime.md); the recording
  /// itself ran without the checks, so the planner charges them (CostModel::checkUs).
  bool checksCollectives = false;
};

/// Device memory facts of the recording rank(s).
struct TraceMemory {
  uint64_t capacityBytes = 0;  ///< device memory capacity (host RAM for CPU runs)
  uint64_t baselineBytes = 0;  ///< in use at step start: shards, optimizer state
};

/// The values of TraceParam::optimizerImpl (params[].optimizer_impl).
inline const std::vector<std::string>& optimizerImpls() {
  static const std::vector<std::string> names{"for_loop", "foreach", "fused"};
  return names;
}

/// One row of the parameter table; ids are the runtime's ds_ids.
struct TraceParam {
  int64_t id = 0;
  std::string name;  ///< qualified name, e.g. "layers.0.attn.wq.weight"
  std::vector<int64_t> shape;
  std::string dtype;       ///< dtype of the master shard
  int64_t numel = 0;       ///< product of shape
  int64_t shardNumel = 0;  ///< ceil(numel / world_size): padded shard length
  bool requiresGrad = true;
  /// The optimizer's per-element state of this rank's shard (AdamW: exp_avg and exp_avg_sq),
  /// bytes, after a recorded optimizer step; absent: not recorded (no planned offload of it).
  std::optional<uint64_t> optimizerStateBytes;
  /// How the optimizer that steps it runs (torch's names): "for_loop" (one parameter at a time),
  /// "foreach" (a call over all it steps) or "fused" (one kernel); absent: not known.
  std::optional<std::string> optimizerImpl;
  /// The param group that steps it, numbered over the recorded optimizers: a foreach or fused
  /// optimizer makes one call per group; absent: not recorded.
  std::optional<int64_t> optimizerGroup;
};

/// A measured collective time for one message size.
struct CalibrationPoint {
  uint64_t bytes = 0;  ///< full (unsharded) message size in bytes
  double us = 0;       ///< measured time in microseconds: from its launch on the host to the host's wait
  /// GPUs: the same call's time on the device, queued behind other work so that the host's launch
  /// and wait are not in it, as a CUDA graph's replay runs it (us). Absent: not timed (CPU ranks).
  std::optional<double> deviceUs = std::nullopt;
};

/// Communication speed measured on the recording cluster.
struct Calibration {
  std::vector<CalibrationPoint> allGather;      ///< by size of the gathered output
  std::vector<CalibrationPoint> reduceScatter;  ///< by size of the full input
  std::vector<CalibrationPoint> allReduce;      ///< by size of the buffer
  std::optional<double> h2dGBps;                ///< host-to-device copy rate (absent on CPU)
  std::optional<double> d2hGBps;                ///< device-to-host copy rate (absent on CPU)
  /// A fixed fp32 matrix product timed on every rank at once (the slowest rank's, us): how fast
  /// the ranks compute beside each other (absent: recorded before it was measured).
  std::optional<double> computeProbeUs;
  /// Traces of a dcplan.graphed_step only (a network file has none): the device time of one
  /// replay of the recorded step captured in one CUDA graph, timed after the recorded steps (the
  /// median of a few replays, the slowest rank's), us. The device-lead step's op times, launched
  /// one by one, add the gaps between kernels that a graph's replay lacks; dcplan plan fits them
  /// to this (docs/planning.md, "A CUDA graph's step"). Absent: not timed.
  std::optional<double> graphStepUs;
};

/// A measurement of a cluster's collectives without a model: times on `worldSize` ranks of one
/// transport, as a trace's calibration (network.h reads and writes its file).
struct Network {
  std::string createdBy;
  int64_t worldSize = 0;    ///< ranks measured; at least 2
  std::string backend;      ///< the transport: "gloo" or "nccl"
  std::string device;       ///< "cpu", "cuda"
  Calibration calibration;  ///< all-gather, reduce-scatter and all-reduce curves
};

/// The streams a trace's op events run on; the one definition of their names.
enum class Stream { Compute, AllGather, Reduce, Copy, Offload, Reload };
/// The trace's name of a stream: "compute", "allgather", "reduce", "copy", "offload", "reload".
const char* streamName(Stream stream);
/// Every stream name, in the enum's order.
const std::vector<std::string>& streamNames();

/// One dc op as the runtime executed it.
struct OpEvent {
  int64_t seq = 0;             ///< position in its graph's op sequence
  std::string op;              ///< dc op name, e.g. "allgather_param"
  std::vector<int64_t> dsIds;  ///< one id ("ds_id"), several for prefetch_params_fused, none for end_backward
  std::optional<int64_t> nUsers;  ///< release_param only
  uint64_t bytes = 0;             ///< bytes moved or freed (gathered size, gradient size)
  std::string dtype;              ///< dtype of those bytes ("" when none)
  std::string stream;             ///< streamName() of the op's stream
  double startUs = 0;             ///< start on its stream, from the graph's start
  double endUs = 0;               ///< end on its stream, from the graph's start
  double computeUs = 0;           ///< compute time since the previous op of the graph
  uint64_t memoryBytes = 0;       ///< device memory in use when the op was issued
  uint64_t peakBytes = 0;         ///< the most in use since the previous op (0: not recorded)
  /// Host time of the compute before the op: from the previous op's return (the step's or the
  /// graph's start for its first op) to this op's call. Absent in older traces.
  std::optional<double> hostUs;
  /// Host time inside the op, from its call to its return. Absent in older traces.
  std::optional<double> issueUs;
  /// The compute before the op as the device runs it with the step queued ahead of it, so that
  /// it never waits for the host (the recorder's device-lead step, docs/recording.md): what a
  /// step replayed as one CUDA graph takes. compute_us of a host-bound step also holds the
  /// device's idle. Absent on CPU ranks and in older traces.
  std::optional<double> deviceUs;
  /// The op's own work on the compute stream in that same device-lead step (a bucket's packing,
  /// the runtime's bookkeeping kernels; the NCCL transport casts shards on its gather stream):
  /// what the op adds to a CUDA graph's replay besides the compute before it. An op that waits
  /// inside (a gather left unwaited that allgather_param or release_param drops, a reload)
  /// holds that wait too. Absent for ops that make the compute stream wait for another (waits,
  /// end_backward: the planner simulates those), on CPU ranks and in older traces.
  std::optional<double> opDeviceUs;
};

/// What a dc op of the trace format does; the trace's validation, the planner's op kinds and
/// the recorder's streams all read it from one table (opRole).
enum class OpRole {
  Gather,       ///< allgather_param: a gather on the all-gather stream
  Prefetch,     ///< prefetch_params_fused: gathers of several parameters in one call
  GatherWait,   ///< wait_allgather
  Release,      ///< release_param
  ReduceGrad,   ///< reduce_grad: a gradient into a bucket, reduced on the reduce stream
  EndBackward,  ///< end_backward: flushes the buckets and waits for their reductions
  Offload,      ///< offload_tensor, offload_parameter: a copy to the host on the offload stream
  Reload,       ///< reload_tensor, reload_parameter: a copy back on the reload stream
  CopyWait,     ///< wait_offload, wait_reload
  Free,         ///< free_tensors
};
/// How many roles there are (tables indexed by role); a role added after Free moves this too.
inline constexpr size_t kOpRoleCount = static_cast<size_t>(OpRole::Free) + 1;

/// The role of a dc op by its name; none for a name the trace format does not know.
std::optional<OpRole> opRole(const std::string& op);

/// Whether a dc op makes the compute stream wait for another stream (wait_allgather,
/// wait_offload, wait_reload, end_backward): its span there is that wait, not its own work, so
/// such an op has no op_device_us.
bool waitsForAnotherStream(const std::string& op);

enum class GraphKind { Forward, Backward };

/// The shape of each tensor argument of a sharded model's forward (args, then kwargs by name, each
/// in torch's pytree order).
using InputShapes = std::vector<std::vector<int64_t>>;

/// "[(2, 64), (2,)]": as Python prints the shapes (inspect, diff, the replay's warning).
std::string inputShapesText(const InputShapes& shapes);

/// A tensor a forward saved for its backward (autograd's saved tensors other than the gathered
/// parameters, docs/recording.md "Saved activations"): what offloading activations could move to
/// the host. One per storage: the views of one storage saved again share it.
struct SavedActivation {
  /// Its saves, counted over the forward's saves of eligible tensors from 0, in order: the
  /// first made it, the others saved a view of the same storage. A replay counts alike.
  std::vector<int64_t> packs;
  uint64_t bytes = 0;  ///< its storage's size
  int64_t seq = 0;     ///< first saved during the compute before this op of the forward
  /// Taken off the device in the recorder's trial step (everything eligible moved to the host as
  /// it was saved), its memory was gone by this op of the forward (the events' count: by the
  /// forward's end); absent where it was still held then (a forward's output) or not tried.
  std::optional<int64_t> freedAt;
  /// First read by the backward during the compute before this op of the same micro-step's
  /// backward; absent where the backward never read it.
  std::optional<int64_t> usedAt;
};

struct TraceGraph {
  int64_t id = 0;
  GraphKind kind = GraphKind::Forward;
  std::vector<OpEvent> events;
  /// Forward graphs: the inputs of this micro-step's forward; absent in older traces.
  std::optional<InputShapes> inputShapes;
  /// Forward graphs: what it saved for the backward, in the order first saved; empty where not
  /// recorded (older traces, ZeRO-1/2 or compiled forwards, DCPLAN_RECORD_ACTIVATIONS=0).
  std::vector<SavedActivation> savedActivations;
};

/// One recorded training step (one micro-step per graph pair when accumulating).
struct TraceStep {
  int64_t index = 0;
  std::vector<TraceGraph> graphs;
  double optimizerUs = 0;  ///< optimizer step time after the last backward
  /// Host time from end_backward's return to the next step's start (absent in older traces).
  std::optional<double> optimizerHostUs;
  /// optimizer_us as the device runs it with the step queued ahead (see OpEvent::deviceUs).
  std::optional<double> optimizerDeviceUs;
};

struct Trace {
  TraceMeta meta;
  TraceMemory memory;
  std::vector<TraceParam> params;
  Calibration calibration;
  std::vector<TraceStep> steps;
};

const char* graphKindName(GraphKind kind);

}  // namespace dcplan::schemas
