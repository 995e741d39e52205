// The in-situ scale of the collectives (see in_situ.h).
#include "dcplan/planner/in_situ.h"

#include <cmath>

#include "dcplan/planner/planner.h"
#include "dcplan/planner/simulator.h"
#include "dcplan/planner/units.h"
#include "dcplan/schemas/units.h"

namespace dcplan::planner {

using schemas::formatMs;

std::optional<InSituFit> fitInSitu(const schemas::Trace& trace, const Workload& w,
                                   std::optional<double> bandwidthGBps) {
  if (!w.hostLane || !w.waitsBlockHost || w.cudaGraph || bandwidthGBps) return std::nullopt;
  if (w.traceWorldSize <= 1 || w.worldSize <= 1) return std::nullopt;
  const CompiledSchedule recorded = compileSchedule(w, defaultSchedule(w));
  auto simulatedUs = [&](double scale) {
    CostModelOptions o = costOptions(w, std::nullopt);
    o.inSituScale = scale;
    return simulate(w, CostModel(trace.calibration, w.traceWorldSize, o), recorded).prediction.stepUs;
  };
  InSituFit fit;
  fit.recordedUs = w.recordedHostUs();
  fit.calibratedUs = simulatedUs(1.0);
  // The simulated step grows with the collectives' times: bisect the scale, on a log scale.
  double lo = std::log(kInSituMin), hi = std::log(kInSituMax);
  if (simulatedUs(kInSituMax) <= fit.recordedUs) {
    lo = hi;
  } else if (simulatedUs(kInSituMin) >= fit.recordedUs) {
    hi = lo;
  } else {
    for (int i = 0; i < 24; ++i) {
      const double mid = 0.5 * (lo + hi);
      (simulatedUs(std::exp(mid)) > fit.recordedUs ? hi : lo) = mid;
    }
  }
  fit.scale = std::exp(0.5 * (lo + hi));
  fit.atBound = lo == hi;
  return fit;
}

std::string inSituText(const InSituFit& fit) {
  std::string text = "collectives in situ: the recorded step took " + formatMs(fit.recordedUs) +
                     " on the host, its own schedule simulated on the calibration " +
                     formatMs(fit.calibratedUs) + "; every collective is taken at " +
                     formatFixed(fit.scale, 2) +
                     "x the calibration's time (CPU ranks: compute and Gloo's threads share the cores)";
  if (fit.atBound) text += "; the scale is at its bound, so the collectives do not explain the difference";
  return text;
}

CostModel plannedCostModel(const schemas::Trace& trace, const Workload& w,
                           std::optional<double> bandwidthGBps, std::optional<InSituFit>* fitOut) {
  CostModelOptions o = costOptions(w, bandwidthGBps);
  std::optional<InSituFit> fit = fitInSitu(trace, w, bandwidthGBps);
  if (fit) o.inSituScale = fit->scale;
  if (fitOut) *fitOut = fit;
  return CostModel(trace.calibration, w.traceWorldSize, o);
}

}  // namespace dcplan::planner
