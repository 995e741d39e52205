// Readable reports of a plan (dcplan inspect) and its predicted timeline as Chrome trace events.
#pragma once

#include <string>

#include "dcplan/schemas/plan.h"
#include "dcplan/schemas/trace.h"

namespace dcplan::planner {

/// Throws std::invalid_argument ("/source/param_signature: ...") when `plan` was
/// made for another model or world size than `trace` has.
void checkPlanMatchesTrace(const schemas::Plan& plan, const schemas::Trace& trace);

/// Summary of `plan`: source, options, schedule, prediction next to the default
/// schedule's. With `trace` (checked with checkPlanMatchesTrace), also the
/// per-layer table (gathers per step, prefetch distance, persistence, buckets)
/// from a simulation of the plan on the trace.
std::string renderPlanReport(const schemas::Plan& plan, const std::string& planName,
                             const schemas::Trace* trace = nullptr, const std::string& traceName = "");

/// A plan with offload: the bound its step is held against (schemas::Prediction::copyBoundUs), what
/// it is made of, and the plan's predicted step over it; one line. Empty without an offload (or
/// from a plan written before the bound was).
std::string copyBoundLine(const schemas::Prediction& predicted);

/// Chrome trace-event JSON (opens in Perfetto / chrome://tracing) of the
/// predicted step: process 1 is the plan, process 2 the default schedule; one
/// thread per stream and a memory counter. One event per line.
std::string renderChromeTrace(const schemas::Plan& plan, const std::string& planName,
                              const schemas::Trace& trace);

/// The plan's simulated memory, op by op, for comparison with a run's allocation log (the replay
/// log's `mem` and `peak`, python -m dcplan.check_replay --curve): JSON with one entry per op of
/// the simulated optimizer step: graph, kind, micro_step, pos (the op's seq), op, `at_bytes` (in
/// use when the op is issued) and `before_bytes` (the most during the compute before it).
std::string renderMemoryCurve(const schemas::Plan& plan, const std::string& planName,
                              const schemas::Trace& trace);

}  // namespace dcplan::planner
