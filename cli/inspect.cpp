// `dcplan inspect FILE`: a readable summary of a trace.
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "dcplan/schemas/io.h"
#include "inspect_plan.h"
#include "subcommands.h"
#include "trace_report.h"

namespace dcplan::cli {
namespace {

using namespace dcplan::schemas;

struct InspectOptions {
  std::string file;
  size_t top = 5;
  InspectPlanOptions plan;
};

void runInspect(const InspectOptions& options) {
  auto doc = readJsonFile(options.file);
  const DocumentKind kind = detectKind(doc, options.file);
  if (kind == DocumentKind::Plan) {
    inspectPlan(doc, options.file, options.plan, std::cout);
    return;
  }
  if (kind == DocumentKind::Network) {
    throw InputError(options.file, {{"/schema",
                                     "a network measurement: inspect reads traces and plans (dcplan validate "
                                     "checks this file; dcplan plan TRACE --network uses it)"}});
  }
  Trace trace;
  auto diags = validateTrace(doc, trace);
  if (!diags.empty()) throw InputError(options.file, std::move(diags));
  printTraceSummary(std::cout, options.file, trace, options.top);
}

}  // namespace

void setupInspect(CLI::App& app) {
  auto options = std::make_shared<InspectOptions>();
  auto* cmd = app.add_subcommand("inspect",
                                 "Summarise a trace (model, op counts, bytes moved, time split) or a plan "
                                 "(schedule, prediction, per-layer table)");
  cmd->add_option("file", options->file, "trace file")->required();
  cmd->add_option("--top", options->top, "how many of the slowest communication ops to list")
      ->capture_default_str();
  addInspectPlanOptions(*cmd, options->plan);
  cmd->callback([options] { runInspect(*options); });
}

}  // namespace dcplan::cli
