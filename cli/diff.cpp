// `dcplan diff A B`: semantic diff of two plans; exit 0 equal, 1 different, 2 bad input.
#include <iostream>
#include <memory>
#include <string>

#include "dcplan/planner/diff.h"
#include "dcplan/planner/units.h"
#include "dcplan/schemas/io.h"
#include "subcommands.h"

namespace dcplan::cli {
namespace {

struct DiffOptions {
  std::string a;
  std::string b;
  bool json = false;
  std::string tolerance = "0";
};

/// "0.01" or "1%": a relative tolerance for the predictions.
double parseTolerance(const std::string& text) {
  std::string s = text;
  bool percent = !s.empty() && s.back() == '%';
  if (percent) s.pop_back();
  size_t used = 0;
  double v = -1;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != s.size() || s.empty() || !(v >= 0) || v > 1e9) {
    throw std::invalid_argument("--tolerance: '" + text + "' is not a relative tolerance (e.g. 0.01 or 1%)");
  }
  return percent ? v / 100 : v;
}

void runDiff(const DiffOptions& o) {
  double tolerance = parseTolerance(o.tolerance);
  schemas::Plan a = schemas::readPlan(o.a);
  schemas::Plan b = schemas::readPlan(o.b);
  planner::PlanDiff diff = planner::diffPlans(a, b, tolerance);
  std::cout << (o.json ? planner::renderDiffJson(diff, o.a, o.b, tolerance)
                       : planner::renderDiffText(diff, o.a, o.b));
  if (!diff.equal()) throw ExitCode{kExitDiffers};
}

}  // namespace

void setupDiff(CLI::App& app) {
  auto o = std::make_shared<DiffOptions>();
  auto* cmd = app.add_subcommand("diff",
                                 "Compare two plans: buckets, prefetch groups, persistent set, predictions "
                                 "(exit 0 equal, 1 different, 2 error)");
  cmd->add_option("a", o->a, "first plan")->required();
  cmd->add_option("b", o->b, "second plan")->required();
  cmd->add_flag("--json", o->json, "print the differences as JSON");
  cmd->add_option("--tolerance", o->tolerance,
                  "relative tolerance for predicted time and memory, e.g. 0.01 or 1%")
      ->capture_default_str();
  cmd->callback([o] { runDiff(*o); });
}

}  // namespace dcplan::cli
