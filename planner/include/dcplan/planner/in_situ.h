// The collectives' cost as a run paid it: fitted to the recorded run on CPU ranks, or to a replay of
// a plan (dcplan plan --calibrate).
#pragma once

#include <optional>
#include <string>

#include "dcplan/planner/cost_model.h"
#include "dcplan/planner/simulator.h"
#include "dcplan/planner/workload.h"
#include "dcplan/schemas/plan.h"
#include "dcplan/schemas/trace.h"

namespace dcplan::planner {

/// How far a run's collectives were from the calibration's times. The calibration times each
/// collective alone; in the job, on CPU ranks, the ranks' compute threads and Gloo's share the
/// cores, and a collective waits for the other ranks to arrive (2 ranks on 2 cores: the demo's
/// recorded step 66 ms, its own schedule simulated on the calibration 38 ms). A run is a
/// measurement of the schedule it ran, so every collective's time is scaled until that schedule,
/// simulated, takes the run's step.
struct InSituFit {
  enum class Source {
    Recording,  ///< the recorded run, which ran the default schedule (CPU ranks)
    Replay,     ///< a replay of a plan, measured by its replay logs (dcplan plan --calibrate)
    Plan,       ///< the scale a calibrated plan carries (options.in_situ_scale)
  };
  Source source = Source::Recording;
  double scale = 1.0;       ///< CostModelOptions::inSituScale, or with `host` the host's (scaleHost)
  /// A replay's fit of the host's pace instead (dcplan plan --calibrate): every host time at
  /// `scale`, the collectives held at collectiveScale (as the recording's fit, or 1, has them).
  bool host = false;
  /// A CUDA graph's replay's fit of the device's pace instead (dcplan plan --calibrate on the
  /// graph replays' device times): every device time at `scale` (scaleDevice), the collectives as
  /// calibrated. A graph has no host to pace it, and its launch gaps are the device's.
  bool device = false;
  /// A replay's fit: the collectives' scale the new plan is made with (`scale` where it fits them).
  double collectiveScale = 1.0;
  double measuredUs = 0;    ///< the run's step (the recorded step's host time, or the replay's)
  double calibratedUs = 0;  ///< its schedule simulated on the calibration as measured
  bool atBound = false;     ///< the scale hit its bound: the collectives do not explain the run (not applied)
};

/// The scales a fit may take; beyond them the run's step differs for some other reason.
inline constexpr double kInSituMin = 0.125;
inline constexpr double kInSituMax = 8.0;

/// The fit to the recorded run, where it applies: a host lane whose host blocks in waits (CPU
/// ranks), collectives between ranks both recorded and planned, and neither --bandwidth nor
/// --network (a what-if of another cluster, whose contention this run says nothing about).
/// nullopt elsewhere.
std::optional<InSituFit> fitInSitu(const schemas::Trace& trace, const Workload& workload,
                                   std::optional<double> bandwidthGBps, const schemas::Network* network);

/// The fit to a replay of `replayed` (a plan made from this trace) whose step measured measuredUs:
/// the collectives' scale, or the host's pace (InSituFit::host) where no collective time explains
/// the run. On a GPU whose replayed plan the host paces, the host's pace first: no collective time
/// shortens such a step, its collectives run on the device at the times the calibration measured
/// there, and its host moves by up to 2x from process to process (docs/benchmarks.md, "Host
/// CPUs"); elsewhere (CPU ranks, in situ; a device-bound step) the collectives first. A CUDA
/// graph's (its replays timed on the device): the device's pace (InSituFit::device). atBound where
/// none explains it.
InSituFit fitToReplay(const schemas::Trace& trace, const Workload& workload, const Schedule& replayed,
                      double measuredUs, std::optional<double> bandwidthGBps,
                      const schemas::Network* network);

/// One line for --explain and dcplan inspect: the run's step, the calibrated one and the scale.
std::string inSituText(const InSituFit& fit);

/// A graphed recording's captured step (the trace's calibration.graph_step_us: the recorded
/// schedule captured in one CUDA graph and replayed) and the device's times fitted to it. The
/// device-lead step launches kernels one by one; a graph replays them without the gaps, and
/// the recorder's times may be further off (1xH200, 0.95B compiled: the recorded schedule
/// simulated 20% over its captured step with the bench's fused AdamW, 122% over with
/// train_llama.py's). Every device time of the step is scaled until the recorded schedule,
/// simulated, takes the captured step's time. What the fit cannot see is how the graph overlaps
/// the recorded schedule's gathers: where the simulation exposes more of them than the graph does,
/// the scale comes out low (the first case: its plan predicted 11% fast; unfitted, 10% slow).
struct CapturedStep {
  double measuredUs = 0;   ///< graph_step_us
  double simulatedUs = 0;  ///< the recorded (default) schedule on the device-lead step's times
  double scale = 1.0;      ///< every device time at this scale (scaleDevice), unless atBound
  bool atBound = false;    ///< the scale hit its bound: not applied, and the plan warns
};

/// The scales the fit may take (the second case above needed 0.43).
inline constexpr double kCapturedScaleMin = 0.25;
inline constexpr double kCapturedScaleMax = 4.0;

/// The fit of a CUDA graph's workload (Workload::cudaGraph) to the trace's captured step, made at the
/// traced world size (a --world-size what-if keeps its scale); nullopt without graph_step_us or for
/// a step the host issues.
std::optional<CapturedStep> capturedStep(const schemas::Trace& trace, const Workload& workload);

/// One line for --explain and dcplan inspect.
std::string capturedStepText(const CapturedStep& step);

/// The workload a plan is made and simulated with (dcplan plan and dcplan inspect alike, before
/// plannedCostModel): the trace's at worldSize (0: the trace's), its step as issued or in one CUDA
/// graph, and, for a --network what-if of CPU ranks, its compute scaled (scaleCompute) by the
/// network's compute probe over the trace's (Calibration::computeProbeUs): the job's ranks share
/// their hosts' cores as the network's did (dcplan.measure_network ran on them). computeScale, where
/// given, gets that factor: 1 without a network or either probe, and on GPUs, each of which
/// computes on its own. A CUDA graph's device times are fitted to the captured step where the
/// trace timed one (capturedStep, applied unless at its bound); captured, where given, gets the fit.
Workload plannedWorkload(const schemas::Trace& trace, int64_t worldSize, StepReplay replay,
                         const schemas::Network* network, double* computeScale = nullptr,
                         std::optional<CapturedStep>* captured = nullptr);

/// How a plan's step is simulated again (dcplan inspect --trace, dcplan check --trace): as it was
/// planned, in one CUDA graph (options.cuda_graph), issued on the device's own times
/// (options.device_times) or on the recorded ones (a plan without either: CPU ranks, a trace
/// without device times, a plan made before options.device_times existed).
StepReplay plannedReplay(const schemas::PlanOptions& options);

/// The cost model a plan is made and simulated with (dcplan plan and dcplan inspect alike): the
/// trace's calibration or the network measured for it (--network: its curves, at its world size),
/// the what-ifs (costOptions), and the plan's own in-situ scale where it carries one (planScale),
/// else the fit to the recorded run where it applies and is not at its bound (then 1). `fit`:
/// which.
CostModel plannedCostModel(const schemas::Trace& trace, const Workload& workload,
                           std::optional<double> bandwidthGBps, const schemas::Network* network = nullptr,
                           std::optional<double> planScale = std::nullopt,
                           std::optional<InSituFit>* fit = nullptr);

}  // namespace dcplan::planner
