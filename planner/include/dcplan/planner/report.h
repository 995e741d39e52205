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

/// Chrome trace-event JSON (opens in Perfetto / chrome://tracing) of the
/// predicted step: process 1 is the plan, process 2 the default schedule; one
/// thread per stream and a memory counter. One event per line.
std::string renderChromeTrace(const schemas::Plan& plan, const std::string& planName,
                              const schemas::Trace& trace);

}  // namespace dcplan::planner
