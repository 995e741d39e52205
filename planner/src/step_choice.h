// Which recorded step a plan is made from, and the micro-steps that make it up.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dcplan/planner/workload.h"
#include "dcplan/schemas/trace.h"

namespace dcplan::planner::detail {

/// The recorded micro-steps of the optimizer step that ends at `end` (steps are micro-steps; an
/// optimizer step is the grad_accum_steps of them ending at one after which the optimizer ran).
std::vector<size_t> microStepsEndingAt(const schemas::Trace& trace, size_t end, int64_t gradAccumSteps);

/// The host time of the optimizer step made of the recorded micro-steps `micro` (every op's
/// host_us and issue_us, and the last one's optimizer_host_us), or nothing where the trace lacks
/// one of them: what the steps are compared by, and what the in-situ scale fits (Workload).
std::optional<double> stepHostUs(const schemas::Trace& trace, const std::vector<size_t>& micro);

/// The recorded step to plan from: the last one after which the optimizer ran, unless the
/// recorded optimizer steps disagree on host time (kStepsAgreeShare): then the median of them
/// (what dcplan check measures of a replay), with `note` saying so. A CUDA graph's plan takes the device's
/// own times, which the recorder measures once: the last step.
size_t steadyOptimizerStep(const schemas::Trace& trace, int64_t gradAccumSteps, StepReplay replay,
                           std::string& note);

}  // namespace dcplan::planner::detail
