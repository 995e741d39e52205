// Which recorded step a plan is made from, and the micro-steps that make it up.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dcplan/planner/workload.h"
#include "dcplan/schemas/trace.h"

namespace dcplan::planner::detail {

/// The recorded micro-steps of the optimizer step that ends at `end` (steps are micro-steps; an
/// optimizer step is the grad_accum_steps of them ending at one after which the optimizer ran).
std::vector<size_t> microStepsEndingAt(const schemas::Trace& trace, size_t end, int64_t gradAccumSteps);

/// The recorded step to plan from: the last one after which the optimizer ran, unless the
/// recorded optimizer steps disagree on host time (kStepsAgreeShare): then the median of them
/// (what dcplan check measures of a replay), with `note` saying so. A CUDA graph's plan takes the device's own times, which the recorder
/// measures once: the last step.
size_t steadyOptimizerStep(const schemas::Trace& trace, int64_t gradAccumSteps, StepReplay replay,
                           std::string& note);

}  // namespace dcplan::planner::detail
