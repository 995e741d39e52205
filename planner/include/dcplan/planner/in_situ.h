// The collectives' cost as the recorded run paid it, on CPU ranks.
#pragma once

#include <optional>
#include <string>

#include "dcplan/planner/cost_model.h"
#include "dcplan/planner/workload.h"
#include "dcplan/schemas/trace.h"

namespace dcplan::planner {

/// How far the recorded run's collectives were from the calibration's times. The calibration times
/// each collective alone; in the job, on CPU ranks, the ranks' compute threads and Gloo's share
/// the cores, and a collective waits for the other ranks to arrive (2 ranks on 2 cores: the demo's
/// recorded step 66 ms, its own schedule simulated on the calibration 38 ms). The recorded run is
/// a measurement of the default schedule, so every collective's time is scaled until the default
/// schedule, simulated, takes the recorded step's host time.
struct InSituFit {
  double scale = 1.0;       ///< CostModelOptions::inSituScale
  double recordedUs = 0;    ///< the recorded step's host time (Workload::recordedHostUs)
  double calibratedUs = 0;  ///< the default schedule simulated on the calibration as measured
  bool atBound = false;     ///< the scale hit kInSituBounds: the collectives do not explain it
  bool fitted() const { return recordedUs > 0; }
};

/// The scales a fit may take; beyond them the recorded step differs for some other reason.
inline constexpr double kInSituMin = 0.125;
inline constexpr double kInSituMax = 8.0;

/// The fit, where it applies: a host lane whose host blocks in waits (CPU ranks), collectives
/// between ranks both recorded and planned, and no --bandwidth (a what-if of another cluster,
/// whose contention this run says nothing about). nullopt elsewhere.
std::optional<InSituFit> fitInSitu(const schemas::Trace& trace, const Workload& workload,
                                   std::optional<double> bandwidthGBps);

/// One line for --explain and dcplan inspect: the recorded and calibrated steps and the scale.
std::string inSituText(const InSituFit& fit);

/// The cost model a plan is made and simulated with (dcplan plan and dcplan inspect alike): the
/// trace's calibration, the what-ifs (costOptions) and the in-situ fit where it applies.
CostModel plannedCostModel(const schemas::Trace& trace, const Workload& workload,
                           std::optional<double> bandwidthGBps, std::optional<InSituFit>* fit = nullptr);

}  // namespace dcplan::planner
