// The planner's view of a trace: one optimizer step as graph runs of typed ops.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "dcplan/planner/runtime_memory.h"
#include "dcplan/schemas/plan.h"
#include "dcplan/schemas/trace.h"

namespace dcplan::planner {

/// Bucket size of the default schedule (the runtime without a plan), in bytes.
inline constexpr uint64_t kDefaultBucketBytes = static_cast<uint64_t>(schemas::kDefaultBucketBytes);

/// The runtime's rule for size-capped buckets: one that holds gradients is flushed before a
/// gradient that would take it past capBytes (a single larger gradient fills one alone).
inline bool flushesBefore(uint64_t bucketBytes, uint64_t nextBytes, uint64_t capBytes) {
  return bucketBytes > 0 && bucketBytes + nextBytes > capBytes;
}

/// The planner reads what an op does from the trace format's op table (schemas::opRole).
using schemas::OpRole;

/// Whether an op starts a transfer on a copy stream (offload_* / reload_*).
inline bool startsCopy(OpRole r) { return r == OpRole::Offload || r == OpRole::Reload; }

/// One op of a graph; `param` indexes Workload::params (not a ds_id).
struct WorkOp {
  OpRole role = OpRole::Free;  ///< from the trace (Free and Prefetch: no scheduling role here)
  int32_t param = -1;
  int64_t seq = 0;           ///< position in the graph's op sequence, as recorded
  uint64_t copyBytes = 0;    ///< startsCopy only
  bool lastRelease = false;  ///< Release only: the graph's last release of this parameter
};

struct WorkParam {
  int64_t id = 0;
  std::string name;
  uint64_t gatherBytes = 0;  ///< full padded size in the gather dtype, planned world size
  uint64_t gradBytes = 0;    ///< full padded size in the reduce dtype, planned world size
  ParamMemory mem;           ///< what the runtime allocates for it, on the planned world size
  bool requiresGrad = true;
  /// The optimizer's per-element state of one rank's shard at the planned world size (the
  /// trace's optimizer_state_bytes, rescaled with the shard); 0: none recorded.
  uint64_t optimizerStateBytes = 0;
  /// The trace's optimizer_impl: "for_loop", "foreach", "fused", or empty (not known).
  std::string optimizerImpl;
  int64_t optimizerGroup = -1;  ///< the trace's optimizer_group; -1: not recorded
};

/// The op structure of a graph id; every run of it must have the same structure.
struct WorkGraph {
  int64_t id = 0;
  schemas::GraphKind kind = schemas::GraphKind::Forward;
  std::vector<WorkOp> ops;
  /// Forward graphs: the inputs of its first run in the step (the plan carries them).
  std::optional<schemas::InputShapes> inputShapes;
};

/// A saved activation of a forward run that offloading can move (the trace's saved_activations
/// entry with freed_at and used_at): off the device from the op by which its memory was gone to
/// the backward op before which the backward reads it.
struct WorkSaved {
  int64_t pack = 0;  ///< its first save: how the plan names it
  uint64_t bytes = 0;
  int32_t seq = 0;      ///< first saved during the compute before this op of the forward (its copy out)
  int32_t freedAt = 0;  ///< gone by this op of the forward (its ops' count: by the forward's end)
  int32_t usedAt = 0;   ///< read during the compute before this op of the backward run (its copy in)
};

/// One execution of a graph within the step, with its own timings.
struct GraphRun {
  int32_t graph = 0;              ///< index into Workload::graphs
  int32_t microStep = 0;          ///< 0-based micro-step of the optimizer step
  std::vector<double> computeUs;  ///< compute before each op
  /// Memory other than baseline, gathered parameters, bucket inputs and (ZeRO-2/3) gradients
  /// waiting in a bucket, as the recorded run held them.
  std::vector<uint64_t> activationBytes;
  /// The most of it during the compute before each op (the trace's peak_bytes; activationBytes
  /// where the trace has none): temporaries that come and go between two ops. The step's first
  /// holds the optimizer step's, scaled to the planned world size under ZeRO-3 (workload.cpp).
  std::vector<uint64_t> computePeakBytes;
  std::vector<double> copyUs;  ///< recorded duration of each op that startsCopy
  /// Workload::ownDeviceTimes only (else empty): each op's own work on the compute stream, before
  /// its effect (a bucket's packing before its launch); 0 where the
  /// trace has no op_device_us (waits; traces recorded before session 12).
  std::vector<double> opDeviceUs;
  /// The host's lane (Workload::hostLane only, else empty): host time of the compute before
  /// each op, and of each op itself as the recorded schedule issued it.
  std::vector<double> hostUs;
  std::vector<double> issueUs;
  /// Forward runs: the saved activations offloading can move, in the order first saved, and the
  /// backward run of the same micro-step that reads them (index into Workload::runs; -1: none,
  /// where the micro-step runs more than one forward or backward).
  std::vector<WorkSaved> saved;
  int32_t backwardRun = -1;

  /// The most activation memory of the run, at an op or between two.
  uint64_t mostActivationBytes() const;
};

struct Workload {
  int64_t traceWorldSize = 1;
  int64_t worldSize = 1;  ///< planned
  int64_t stage = 3;
  int64_t gradAccumSteps = 1;
  std::string paramDtype;
  std::string reduceDtype;
  /// The least, over the recorded optimizer steps (one micro-step each), that the compute before a
  /// step's first op held above that op's memory: the optimizer step's temporaries, which an
  /// offloading plan models (what a loaded machine leaves there beside them only adds); scaled
  /// to the planned world size under ZeRO-3, as the first op's computePeakBytes is.
  uint64_t leastOptimizerExcessBytes = std::numeric_limits<uint64_t>::max();
  uint64_t baselineBytes = 0;  ///< shards and optimizer state, re-scaled to the planned world
  /// The trace has optimizer_state_bytes (of parameters its recorder saw an optimizer step):
  /// an offload can be planned for those.
  bool optimizerStateRecorded = false;
  RuntimeMemory memory;  ///< the transport's transient buffers and allocator rounding
  uint64_t capacityBytes = 0;
  double optimizerUs = 0;
  /// The trace has host times for every op of the step (host_us, issue_us, optimizer_host_us):
  /// the simulator runs a host lane beside the device's, so a host-bound step is predicted so.
  bool hostLane = false;
  double optimizerHostUs = 0;
  /// The host blocks in a wait (Gloo on CPU ranks: the compute is the host); on a GPU a wait
  /// only holds the compute stream back.
  bool waitsBlockHost = false;
  /// Planned for a step replayed as one CUDA graph (StepReplay::CudaGraph): compute and optimizer
  /// times are the device's own (device_us), the host issues nothing, no host lane.
  bool cudaGraph = false;
  /// The device lane runs the device's own times (device_us, op_device_us, optimizer_device_us,
  /// from the recorder's device-lead step): a CUDA graph's, and a GPU's eager step with a host
  /// lane where the trace has them; else the recorded run's device times (compute_us).
  bool ownDeviceTimes = false;
  /// The replay checks each collective with the ranks first (trace meta.checks_collectives; never
  /// in a CUDA graph, which cannot capture the check, nor on one rank, which has no other to agree
  /// with; only with a host lane, which it is charged on): CostModel::checkUs per call.
  bool checksCollectives = false;
  int64_t traceStep = 0;  ///< index of the recorded step used
  /// Where the recorded optimizer steps disagree on host time (kStepsAgreeShare): each one's, and
  /// which traceStep is (the median); empty where they agree and traceStep is the last.
  std::string stepChoice;
  std::vector<WorkParam> params;
  std::vector<WorkGraph> graphs;  ///< distinct graph ids, in first-run order
  std::vector<GraphRun> runs;     ///< the optimizer step, in execution order

  /// Index into params for a ds_id, -1 when unknown.
  int32_t paramIndex(int64_t id) const;
  /// Index into graphs for a graph id, -1 when unknown.
  int32_t graphIndex(int64_t id) const;
  /// Total compute of the step (all runs; with ownDeviceTimes the ops' own device work too), microseconds.
  double computeUs() const;
  /// The ops' own device work of the step (ownDeviceTimes: op_device_us), microseconds; in computeUs.
  double opDeviceUs() const;
  /// The recorded step's host time (hostLane: every op's host_us and issue_us, and
  /// optimizer_host_us: detail::stepHostUs), microseconds; 0 without a host lane.
  double recordedHostUs = 0;

  std::vector<int64_t> sortedIds_;  ///< ds_ids ascending, for paramIndex
  std::vector<int32_t> sortedIdx_;
};

/// How the planned step will be replayed, which decides the times it is planned with.
enum class StepReplay {
  Issued,     ///< the host issues every op each step (hooks, compiled graphs): recorded times, and
              ///< on a GPU the device's own where the trace has them all (Workload::ownDeviceTimes)
  IssuedOnRecordedTimes,  ///< issued, on the recorded compute_us only (a plan made so: options.device_times)
  CudaGraph,  ///< one CUDA graph (dcplan.graphed_step): the device's own times (device_us)
};

/// Recorded optimizer steps whose host times differ by more than this share of the fastest's
/// disagree: the step planned from is then the median (the statistic dcplan check measures of a
/// replay), not the last, and the plan says so.
inline constexpr double kStepsAgreeShare = 0.10;

/// Builds the planner's view from one recorded optimizer step of `trace` (the last, or the
/// median where the steps disagree: kStepsAgreeShare), for `worldSize` ranks (0: as recorded).
/// Throws std::invalid_argument naming the trace element (JSON pointer) when the trace cannot be
/// planned: graphs of one id whose runs differ, an op on an unknown parameter, no steps, and for
/// a CUDA graph an op or optimizer step without the device's own time.
Workload makeWorkload(const schemas::Trace& trace, int64_t worldSize = 0,
                      StepReplay replay = StepReplay::Issued);

/// Whether op, in graph g, ends a persistent copy in a ZeRO-3 backward before an optimizer step
/// (the step makes it stale): a trainable parameter's last release in the graph. The simulator
/// drops the copy there, and a plan lists these positions (PlanGraph::persistentEnds) for the
/// runtime, which drops it at the same op.
bool endsPersistentCopy(const Workload& w, const WorkGraph& g, const WorkOp& op);

/// The releases of g where the copies of `persistent` (by param index) end before an optimizer
/// step (endsPersistentCopy), as a plan lists them (PlanGraph::persistentEnds).
std::vector<schemas::PersistentEnd> persistentEnds(const Workload& w, const WorkGraph& g,
                                                   const std::vector<char>& persistent);

/// The recorded compute run at another rate: each op's compute, host and issue times and the
/// optimizer's (device and host), times `factor`. Collectives are the cost model's, and recorded
/// copies (copyUs) are kept: their rate is the memory's, not the cores'.
void scaleCompute(Workload& workload, double factor);

/// The recorded host at another pace: its host and issue times and the optimizer's host time,
/// times `factor`; where the host is the compute (Workload::waitsBlockHost, CPU ranks), all of
/// scaleCompute. A GPU's own times are kept.
void scaleHost(Workload& workload, double factor);

/// The device's own times at another rate (Workload::ownDeviceTimes): each op's compute before it,
/// its own work (opDeviceUs) and the optimizer's, times `factor`; the host's times, collectives and
/// copies are kept. A CUDA graph's times fitted to its captured step (capturedStep), or to the
/// replays of a plan for it (dcplan plan --calibrate: options.device_scale).
void scaleDevice(Workload& workload, double factor);

/// A plan's fit to a replay of an earlier plan (dcplan plan --calibrate: options.host_scale,
/// options.device_scale; absent: not fitted), applied after the captured-step fit: the one place
/// the planner (makePlan) and the check of a plan (simulatePlan) scale a workload by them.
void applyReplayFit(Workload& workload, std::optional<double> hostScale, std::optional<double> deviceScale);

/// The median of `values` (the upper of the two middle ones where their count is even), which it
/// reorders; they must not be empty.
double upperMedian(std::vector<double>& values);

/// The host time of one gather call, from a trace with host times (Workload::hostLane): the
/// median issue_us of the recorded run's allgather_param that launched a gather, less the median
/// of its release_param (an op of the same dispatch that moves nothing). nullopt without host
/// times or without both kinds of op.
std::optional<double> measuredLaunchUs(const Workload& workload);

/// How many gathers each parameter costs per optimizer step when every gather
/// happens on use (by param index): what persistence would save, plus one.
std::vector<int32_t> gathersPerStep(const Workload& workload);

}  // namespace dcplan::planner
