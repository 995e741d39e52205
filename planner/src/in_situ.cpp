// The in-situ scale of the collectives (see in_situ.h).
#include "dcplan/planner/in_situ.h"

#include <cmath>
#include <functional>

#include "dcplan/planner/planner.h"
#include "dcplan/planner/units.h"
#include "dcplan/schemas/units.h"

namespace dcplan::planner {

using schemas::formatMs;

namespace {

CostModel scaledCost(const schemas::Trace& trace, const Workload& w, std::optional<double> bandwidthGBps,
                     const schemas::Network* network, double scale) {
  CostModelOptions o = costOptions(w, bandwidthGBps);
  o.inSituScale = scale;
  if (!network) return CostModel(trace.calibration, w.traceWorldSize, o);
  // The network's collectives; the host link's rates where it measured them (on GPUs), else the trace's.
  schemas::Calibration measured = network->calibration;
  if (!measured.h2dGBps) measured.h2dGBps = trace.calibration.h2dGBps;
  if (!measured.d2hGBps) measured.d2hGBps = trace.calibration.d2hGBps;
  return CostModel(measured, network->worldSize, o);
}

struct Bisected {
  double scale = 1.0;
  bool atBound = false;
};

/// The scale in [least, most] at which stepAt(scale), which grows with it, is measuredUs:
/// bisected on a log scale; atBound where it lies outside.
Bisected bisectScale(double measuredUs, double least, double most, const std::function<double(double)>& stepAt) {
  double lo = std::log(least), hi = std::log(most);
  if (stepAt(most) <= measuredUs) {
    lo = hi;
  } else if (stepAt(least) >= measuredUs) {
    hi = lo;
  } else {
    for (int i = 0; i < 24; ++i) {
      const double mid = 0.5 * (lo + hi);
      (stepAt(std::exp(mid)) > measuredUs ? hi : lo) = mid;
    }
  }
  return {std::exp(0.5 * (lo + hi)), lo == hi};
}

InSituFit bisect(InSituFit::Source source, double measuredUs, const std::function<double(double)>& stepAt) {
  InSituFit fit;
  fit.source = source;
  fit.measuredUs = measuredUs;
  fit.calibratedUs = stepAt(1.0);
  const Bisected b = bisectScale(measuredUs, kInSituMin, kInSituMax, stepAt);
  fit.scale = b.scale;
  fit.atBound = b.atBound;
  return fit;
}

}  // namespace

std::optional<InSituFit> fitInSitu(const schemas::Trace& trace, const Workload& w,
                                   std::optional<double> bandwidthGBps, const schemas::Network* network) {
  if (!w.hostLane || !w.waitsBlockHost || w.cudaGraph || bandwidthGBps || network) return std::nullopt;
  // Fitted where the run's collectives are the plan's kind: between ranks, recorded and planned, or
  // at one rank both (the transport's own copies, which the host makes beside its compute: a
  // 1-rank step's gathers took 86 us each in the run, 60 as calibrated). A 1-rank trace says
  // nothing of a network, nor a trace of several ranks of one rank's copies.
  const bool betweenRanks = w.traceWorldSize > 1 && w.worldSize > 1;
  const bool oneRank = w.traceWorldSize == 1 && w.worldSize == 1;
  if (!betweenRanks && !oneRank) return std::nullopt;
  // Fitted where the recorded run ran (the traced world size); a --world-size what-if keeps the
  // scale, with its own ring factor and shards on top.
  const Workload traced =
      w.worldSize == w.traceWorldSize ? w : makeWorkload(trace, w.traceWorldSize, StepReplay::Issued);
  const CompiledSchedule recorded = compileSchedule(traced, defaultSchedule(traced));
  return bisect(InSituFit::Source::Recording, traced.recordedHostUs, [&](double scale) {
    return simulate(traced, scaledCost(trace, traced, std::nullopt, nullptr, scale), recorded)
        .prediction.stepUs;
  });
}

InSituFit fitToReplay(const schemas::Trace& trace, const Workload& w, const Schedule& replayed,
                      double measuredUs, std::optional<double> bandwidthGBps,
                      const schemas::Network* network) {
  const CompiledSchedule def = compileSchedule(w, defaultSchedule(w));
  const CompiledSchedule plan = compileSchedule(w, replayed);
  auto stepOf = [&](const Workload& run, const CostModel& cost) {
    const SimResult d = simulate(run, cost, def);  // as dcplan inspect simulates a plan
    return simulate(run, cost, plan, againstRecorded(d)).prediction.stepUs;
  };
  auto collectives = [&] {
    InSituFit fit = bisect(InSituFit::Source::Replay, measuredUs, [&](double scale) {
      return stepOf(w, scaledCost(trace, w, bandwidthGBps, network, scale));
    });
    fit.collectiveScale = fit.scale;
    return fit;
  };
  // A pace fitted with the collectives held as the recording's fit has them: the host's
  // (scaleHost) or the device's (scaleDevice).
  auto paced = [&](void (*scaleTimes)(Workload&, double)) {
    const double held = plannedCostModel(trace, w, bandwidthGBps, network).inSituScale();
    InSituFit fit = bisect(InSituFit::Source::Replay, measuredUs, [&](double scale) {
      Workload run = w;
      scaleTimes(run, scale);
      // The cost model of the paced workload, as dcplan plan makes it after scaling: its launch
      // charge is measured from the paced issue times.
      return stepOf(run, scaledCost(trace, run, bandwidthGBps, network, held));
    });
    fit.collectiveScale = held;
    return fit;
  };
  auto host = [&] {
    InSituFit fit = paced(scaleHost);
    fit.host = true;
    return fit;
  };
  if (w.cudaGraph) {
    // The graph's replays ran the plan's kernels without the device-lead step's launch gaps, on
    // the device the trace measured or another: its own times, scaled.
    InSituFit fit = paced(scaleDevice);
    fit.device = true;
    return fit;
  }
  if (!w.hostLane) return collectives();
  // The host first on a GPU whose replayed plan the host paces: no collective time shortens such
  // a step, and the host's speed is what moves between processes there. Elsewhere (CPU ranks, or
  // a device-bound step) the collectives first.
  const CostModel asCalibrated = scaledCost(trace, w, bandwidthGBps, network, 1.0);
  const SimResult asPlanned =
      simulate(w, asCalibrated, plan, againstRecorded(simulate(w, asCalibrated, def)));
  const bool hostFirst = !w.waitsBlockHost && asPlanned.hostUs >= asPlanned.prediction.stepUs - 1.0;
  const InSituFit first = hostFirst ? host() : collectives();
  if (!first.atBound) return first;
  const InSituFit second = hostFirst ? collectives() : host();
  return second.atBound ? first : second;
}

std::string inSituText(const InSituFit& fit) {
  const std::string scale = formatFixed(fit.scale, 2) + "x the calibration's time";
  switch (fit.source) {
    case InSituFit::Source::Plan:
      return "collectives in situ: " + scale + ", the scale the plan was made with (options.in_situ_scale)";
    case InSituFit::Source::Replay:
      if (fit.device) {
        return "device calibrated on a replay of the graph: it measured " + formatMs(fit.measuredUs) +
               " a replay, its plan simulated " + formatMs(fit.calibratedUs) +
               "; every device time is taken at " + formatFixed(fit.scale, 3) +
               "x the trace's (after its captured-step fit, where it has one)" +
               (fit.atBound ? "; the scale is at its bound, so the device's pace does not explain the difference"
                            : "");
      }
      if (fit.host) {
        return "host calibrated on a replay: it measured " + formatMs(fit.measuredUs) +
               " a step, its plan simulated on the recording's host times " + formatMs(fit.calibratedUs) +
               "; every host time is taken at " + formatFixed(fit.scale, 2) + "x the recording's" +
               (fit.atBound
                    ? "; the scale is at its bound, so the host's pace does not explain the difference"
                    : "");
      }
      return "collectives calibrated on a replay: it measured " + formatMs(fit.measuredUs) +
             " a step, its plan simulated on the trace's calibration " + formatMs(fit.calibratedUs) +
             "; every collective is taken at " + scale +
             (fit.atBound ? "; the scale is at its bound, so the collectives do not explain the difference"
                          : "");
    case InSituFit::Source::Recording:
      break;
  }
  return "collectives in situ: the recorded step took " + formatMs(fit.measuredUs) +
         " on the host, its own schedule simulated on the calibration " + formatMs(fit.calibratedUs) +
         "; every collective is taken at " + scale +
         " (CPU ranks: the host's compute and the collectives share its cores)" +
         (fit.atBound ? "; that is the scale's bound, so the collectives do not explain the difference: not "
                        "applied, planned with the calibration as measured"
                      : "");
}

std::optional<CapturedStep> capturedStep(const schemas::Trace& trace, const Workload& w) {
  const std::optional<double>& measured = trace.calibration.graphStepUs;
  if (!w.cudaGraph || !measured) return std::nullopt;
  const Workload traced =
      w.worldSize == w.traceWorldSize ? w : makeWorkload(trace, w.traceWorldSize, StepReplay::CudaGraph);
  // The recording ran the default schedule, and so did the replays it timed.
  const CompiledSchedule recorded = compileSchedule(traced, defaultSchedule(traced));
  const CostModel cost = plannedCostModel(trace, traced, std::nullopt);
  auto stepAt = [&](double scale) {
    Workload scaled = traced;
    scaleDevice(scaled, scale);
    return simulate(scaled, cost, recorded).prediction.stepUs;
  };
  CapturedStep step;
  step.measuredUs = *measured;
  step.simulatedUs = stepAt(1.0);
  const Bisected b = bisectScale(*measured, kCapturedScaleMin, kCapturedScaleMax, stepAt);
  step.scale = b.scale;
  step.atBound = b.atBound;
  return step;
}

std::string capturedStepText(const CapturedStep& step) {
  const std::string text = "captured: the recorded schedule took " + formatMs(step.measuredUs) +
                           " a replay in one CUDA graph (calibration.graph_step_us), simulated on the "
                           "device-lead step's times " +
                           formatMs(step.simulatedUs);
  if (step.atBound) {
    return text + "; no scale between " + formatFixed(kCapturedScaleMin, 2) + "x and " +
           formatFixed(kCapturedScaleMax, 0) +
           "x of the device's times explains that: not applied, planned on the device-lead step's times "
           "(dcplan plan --calibrate on a replay log of the graphed plan fits them)";
  }
  return text + "; every device time at " + formatFixed(step.scale, 3) + "x";
}

StepReplay plannedReplay(const schemas::PlanOptions& options) {
  if (options.cudaGraph) return StepReplay::CudaGraph;
  return options.deviceTimes ? StepReplay::Issued : StepReplay::IssuedOnRecordedTimes;
}

Workload plannedWorkload(const schemas::Trace& trace, int64_t worldSize, StepReplay replay,
                         const schemas::Network* network, double* computeScale,
                         std::optional<CapturedStep>* captured) {
  Workload w = makeWorkload(trace, worldSize, replay);
  const std::optional<CapturedStep> fit = capturedStep(trace, w);
  if (fit && !fit->atBound) scaleDevice(w, fit->scale);
  if (captured) *captured = fit;
  double factor = 1.0;
  const std::optional<double>& recorded = trace.calibration.computeProbeUs;
  if (network && w.waitsBlockHost && recorded && network->calibration.computeProbeUs) {
    factor = *network->calibration.computeProbeUs / *recorded;
    scaleCompute(w, factor);
  }
  if (computeScale) *computeScale = factor;
  return w;
}

CostModel plannedCostModel(const schemas::Trace& trace, const Workload& w,
                           std::optional<double> bandwidthGBps, const schemas::Network* network,
                           std::optional<double> planScale, std::optional<InSituFit>* fitOut) {
  std::optional<InSituFit> fit;
  if (planScale) {
    fit = InSituFit{};
    fit->source = InSituFit::Source::Plan;
    fit->scale = *planScale;
  } else {
    fit = fitInSitu(trace, w, bandwidthGBps, network);
  }
  if (fitOut) *fitOut = fit;
  return scaledCost(trace, w, bandwidthGBps, network, fit && !fit->atBound ? fit->scale : 1.0);
}

}  // namespace dcplan::planner
