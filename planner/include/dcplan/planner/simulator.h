// Discrete-event simulation of one optimizer step under a communication schedule.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dcplan/planner/activation_offload.h"
#include "dcplan/planner/cost_model.h"
#include "dcplan/planner/offload.h"
#include "dcplan/planner/workload.h"
#include "dcplan/schemas/plan.h"

namespace dcplan::planner {

/// The decisions a plan carries, in the plan's own terms (ds_ids, positions).
struct Schedule {
  std::vector<int64_t> persistent;                      ///< ds_ids kept gathered
  std::vector<schemas::PlanGraph> graphs;               ///< prefetch groups and buckets per graph id
  std::vector<schemas::OffloadGroup> optimizerOffload;  ///< state kept on the host between steps
};

/// A Schedule resolved against a Workload: indices instead of ids, for speed.
struct CompiledSchedule {
  std::vector<char> persistent;  ///< by param index
  uint64_t persistentBytes = 0;
  struct Graph {
    std::vector<int32_t> groupBegin;                 ///< CSR by op index: groups issued before op i
    std::vector<std::vector<int32_t>> groups;        ///< param indices of each group
    std::vector<int32_t> bucketOfOp;                 ///< ReduceGrad op -> bucket, else -1
    std::vector<std::vector<int32_t>> bucketParams;  ///< param indices of each bucket
    std::vector<int32_t> bucketSize;                 ///< members per bucket
    std::vector<uint64_t> bucketBytes;
    /// Release ops (by op index) where a persistent copy ends before an optimizer step: the
    /// plan's persistent_ends; for a schedule naming none (made before the field, or by hand),
    /// endsPersistentCopy's, the rule the planner names them by.
    std::vector<char> endsPersistent;
  };
  std::vector<Graph> graphs;  ///< by Workload graph index
  CompiledOffload offload;
  CompiledActivations activations;  ///< the forward graphs' offload_saves
};

/// Resolves `schedule` against `workload`. Throws std::invalid_argument with a
/// JSON pointer into the plan ("/graphs/1/buckets/3/ds_ids/0: ...") when the
/// schedule does not fit the trace: unknown graph or id, a position past the
/// graph's end, a gradient in no bucket or in two.
CompiledSchedule compileSchedule(const Workload& workload, const Schedule& schedule);

/// The simulator uses the compute, allgather, reduce and copy streams of the trace.
using schemas::Stream;
using schemas::streamName;

struct TimelineEvent {
  Stream stream = Stream::Compute;
  std::string name;
  int32_t run = 0;  ///< index into Workload::runs
  int64_t seq = 0;  ///< position of the op that issued it
  std::vector<int64_t> dsIds;
  uint64_t bytes = 0;
  double startUs = 0;
  double endUs = 0;
};

struct MemorySample {
  double us = 0;
  uint64_t bytes = 0;
  int32_t run = -1;   ///< the graph run (-1: the optimizer step)
  int64_t seq = -1;   ///< the op of that run (-1: after its last op)
  bool atOp = false;  ///< at the op (its memory_bytes), else during the compute before it (peak_bytes)
  /// The host's clock then (the host lane; without one, the device's `us`): before an op, when
  /// the host enters it, which a replay log's op line times.
  double hostUs = 0;
};

/// What happened to one gather call (a prefetch group or an on-demand gather).
struct GatherRecord {
  int32_t run = 0;
  int64_t issueSeq = 0;
  double issueUs = 0;
  double endUs = 0;
  std::vector<int32_t> params;
};

struct SimResult {
  schemas::Prediction prediction;
  double computeUs = 0;  ///< sum of compute over the step
  double optimizerUs = 0;
  double gatherBusyUs = 0;  ///< time the all-gather stream was busy
  double masterReloadUs = 0;  ///< offloaded master shards copied in for gathers
  /// How much those copies delay their gathers (on CPU ranks, where the host copies: all of them).
  double masterReloadExposedUs = 0;
  double activationInUs = 0;   ///< the saved activations' copies back to the device
  double activationOutUs = 0;  ///< and to the host
  double reduceBusyUs = 0;
  int64_t gatherCalls = 0;
  int64_t reduceCalls = 0;
  /// Every collective call the step issues (what the launch charge and the checks count).
  int64_t calls() const { return gatherCalls + reduceCalls; }
  /// Host time of the collectives issued beyond the recorded run's (SimOptions::referenceCalls):
  /// added to prediction.stepUs without a host lane; with one (Workload::hostLane), charged on
  /// the host lane op by op (SimOptions::reference) and negative where the schedule issues fewer.
  double launchDeltaUs = 0;
  /// Host time of the agreement checks, one before each call's launch (CostModel::checkUs), in
  /// which the host blocks; simulations against the recorded run only (the recording ran without).
  double checkUs = 0;
  /// The host lane's end: when the host has issued the whole step, optimizer included (0
  /// without a host lane). prediction.stepUs above it: the device bounds the step.
  double hostUs = 0;
  /// A GPU's host lane: of the device's idle time, what the host alone would have left idle, waiting
  /// for it to issue its work (its stretches, the optimizer, the step's end). Not communication:
  /// prediction.exposedCommUs leaves it out. Zero on CPU ranks, whose host is the device.
  double hostBoundUs = 0;
  /// Collectives issued at each op of the step (runs in order, ops in order): the reference
  /// of a host lane's launch charge (SimOptions::reference).
  std::vector<int32_t> callsAtOp;
  /// Host lane, the recorded run's simulation (no SimOptions::reference): the median recorded
  /// issue time of its gathers, releases and reduce_grads that issued no collective, by role
  /// (quietIssueUs); negative: none. What an op that issues none under a plan costs.
  std::vector<double> quietIssueByRole;
  /// What an op of `role` that issues no collective costs the host, by the recorded run: its own
  /// role's quiet ops, else (a gather on use always launches) a release's, which like a gather
  /// served from a held copy only updates the runtime's bookkeeping; nullopt without either.
  std::optional<double> quietIssueUs(schemas::OpRole role) const;
  /// Host lane: how far the device was behind the host when the backward ended. Where the
  /// script synchronises between steps (most do, to read the loss), the recorded
  /// optimizer_host_us holds waiting that long for the device (SimOptions::reference).
  double optimizerWaitUs = 0;
  /// Compute stalled at waits for each parameter's gathers after its first one
  /// in the step, by param index: what keeping it gathered could save.
  std::vector<double> repeatStallUs;
  std::vector<GatherRecord> gathers;  ///< only with SimOptions::record
  /// Only with SimOptions::record: the memory in use as each op of the step is entered, before
  /// the prefetches launched there (runs in order, ops in order; what the runtime measures there).
  std::vector<uint64_t> entryBytes;
  std::vector<TimelineEvent> timeline;
  std::vector<MemorySample> memory;
};

struct SimOptions {
  bool record = false;  ///< fill gathers, timeline and memory (slower)
  /// Collectives the recorded run issued (that of the default schedule, whose host cost the
  /// recorded compute holds); -1: no launch cost. Each call more adds cost.launchUs().
  int64_t referenceCalls = -1;
  /// With a host lane: the simulation of the recorded run (the default schedule). An op is
  /// charged cost.launchUs() per call more (or less) than that run issued at it
  /// (SimResult::callsAtOp), and the host's time after the backward is taken less the wait for
  /// the device that run implies (SimResult::optimizerWaitUs): the device's own, not the
  /// recorded run's, then decides when the step ends.
  const SimResult* reference = nullptr;
};

/// Options that simulate a schedule against `recorded`, the simulation of the recorded run (the
/// default schedule): its calls are the launch charge's reference, and with a host lane its wait.
inline SimOptions againstRecorded(const SimResult& recorded, bool record = false) {
  SimOptions o;
  o.record = record;
  o.referenceCalls = recorded.calls();
  o.reference = &recorded;
  return o;
}

/// Runs one optimizer step. Rules: the compute stream runs the recorded compute
/// between ops and blocks at a wait until its gather is done; with a host lane
/// (Workload::hostLane) the host issues each stretch of compute in its recorded host time
/// and each op in its issue time, and the device runs a stretch no earlier than the host
/// issued it (on Gloo the host is the compute and blocks in waits); gathers run one at
/// a time on the all-gather stream in issue order, a fused group as one call;
/// a bucket is reduced on the reduce stream once its last gradient is ready
/// (end_backward flushes partial buckets); the optimizer starts when compute and
/// every reduction are done. A persistent parameter is gathered once per step, at
/// its first gather or prefetch, and kept. Memory: baseline + activations +
/// gathered parameters from issue to release + persistent parameters + bucket
/// buffers from first gradient to the end of their reduction.
SimResult simulate(const Workload& workload, const CostModel& cost, const CompiledSchedule& schedule,
                   const SimOptions& options = {});

/// The default schedule (compiled: def) as a replay runs it, given `recorded`, the simulation of
/// the recorded run: a replay makes the agreement checks its recording did not
/// (CostModel::replayChecks), so it is simulated again against the recorded run; else it is
/// the recorded run itself, as it was simulated. record: SimOptions::record of a new simulation.
inline SimResult replayedDefault(const Workload& workload, const CostModel& cost, const CompiledSchedule& def,
                                 const SimResult& recorded, bool record = false) {
  if (!cost.replayChecks()) return recorded;
  return simulate(workload, cost, def, againstRecorded(recorded, record));
}

/// Exposed communication = step - compute - optimizer - what offload copies add to the optimizer.
inline double exposedUs(const SimResult& r) { return r.prediction.exposedCommUs; }

}  // namespace dcplan::planner
