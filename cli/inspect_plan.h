// The plan half of `dcplan inspect`: options and the report, over planner/report.h.
#pragma once

#include <ostream>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json_fwd.hpp>

namespace dcplan::cli {

struct InspectPlanOptions {
  std::string trace;        ///< --trace: simulate on this trace for the per-layer table
  std::string chromeTrace;  ///< --chrome-trace: write the predicted timeline here
  std::string memoryCurve;  ///< --memory-curve: write the simulated memory per op here
};

/// Adds --trace, --chrome-trace and --memory-curve to the inspect subcommand.
void addInspectPlanOptions(CLI::App& cmd, InspectPlanOptions& options);

/// Validates `doc` as a plan and prints its report; throws schemas::InputError
/// naming the file (the plan's, or the trace's) on bad input.
void inspectPlan(const nlohmann::ordered_json& doc, const std::string& file,
                 const InspectPlanOptions& options, std::ostream& out);

}  // namespace dcplan::cli
