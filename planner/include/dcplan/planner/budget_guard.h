// What the runtime's budget guard reads from a plan: the memory the plan's choices that hold a
// parameter's copy ahead of its use (a prefetch group's launch, a persistent parameter kept at its
// release) hold until that use, and the memory at the step's start to compare the run with.
#pragma once

#include "dcplan/planner/simulator.h"
#include "dcplan/planner/workload.h"
#include "dcplan/schemas/plan.h"

namespace dcplan::planner {

/// Sets what the budget guard reads in `plan` (its schedule, simulated as `sim` with
/// SimOptions::record): each prefetch group's peakBytes, the most memory held from its launch
/// until the op that gathers its last member (the run's end where one is not gathered there),
/// over every run of its graph in the step; and plan.guard: the memory as the step's first op
/// is entered and, ZeRO-3, for each persistent id the most memory held from one of its releases
/// until a later op of the step gathers it again (0 where none does).
void setGuardPeaks(const Workload& w, const SimResult& sim, schemas::Plan& plan);

}  // namespace dcplan::planner
