// `dcplan inspect PLAN [--trace TRACE] [--chrome-trace OUT.json] [--memory-curve OUT.json]`: plan report and
// predicted timeline.
#include "inspect_plan.h"

#include <nlohmann/json.hpp>

#include "dcplan/planner/report.h"
#include "dcplan/schemas/io.h"

namespace dcplan::cli {

void addInspectPlanOptions(CLI::App& cmd, InspectPlanOptions& o) {
  cmd.add_option("--trace", o.trace, "plans: the trace to simulate the plan on, for the per-layer table");
  cmd.add_option("--chrome-trace", o.chromeTrace,
                 "plans: write the predicted timeline as Chrome trace events (needs --trace)");
  cmd.add_option("--memory-curve", o.memoryCurve,
                 "plans: write the simulated memory of each op as JSON, for python -m dcplan.check_replay "
                 "--curve (needs --trace)");
}

void inspectPlan(const nlohmann::ordered_json& doc, const std::string& file, const InspectPlanOptions& o,
                 std::ostream& out) {
  using namespace dcplan::schemas;
  Plan plan;
  auto diags = validatePlan(doc, plan);
  if (!diags.empty()) throw InputError(file, std::move(diags));
  if (!o.chromeTrace.empty() && o.trace.empty()) {
    throw InputError(file,
                     {{"", "--chrome-trace needs --trace TRACE: the timeline is simulated on the trace"}});
  }
  if (!o.memoryCurve.empty() && o.trace.empty()) {
    throw InputError(file,
                     {{"", "--memory-curve needs --trace TRACE: the memory is simulated on the trace"}});
  }
  if (o.trace.empty()) {
    out << planner::renderPlanReport(plan, file);
    return;
  }
  Trace trace = readTrace(o.trace);
  try {
    out << planner::renderPlanReport(plan, file, &trace, o.trace);
    if (!o.chromeTrace.empty()) {
      writeFileAtomically(o.chromeTrace, planner::renderChromeTrace(plan, file, trace));
      out << "\nwrote the predicted timeline to " << o.chromeTrace << "\n";
    }
    if (!o.memoryCurve.empty()) {
      writeFileAtomically(o.memoryCurve, planner::renderMemoryCurve(plan, file, trace));
      out << "\nwrote the simulated memory per op to " << o.memoryCurve << "\n";
    }
  } catch (const std::invalid_argument& e) {
    // The plan does not fit the trace: name the plan, the pointer is into it.
    throw InputError(file, {{"", std::string(e.what()) + " (trace " + o.trace + ")"}});
  }
}

}  // namespace dcplan::cli
