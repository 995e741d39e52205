// `dcplan inspect FILE`: a readable summary of a trace.
#include <cstdio>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "dcplan/schemas/io.h"
#include "dcplan/schemas/trace_summary.h"
#include "dcplan/schemas/units.h"
#include "inspect_plan.h"
#include "subcommands.h"

namespace dcplan::cli {
namespace {

using namespace dcplan::schemas;

struct InspectOptions {
  std::string file;
  size_t top = 5;
  InspectPlanOptions plan;
};

std::string percent(double part, double whole) {
  char out[16];
  std::snprintf(out, sizeof out, "%.1f%%", whole > 0 ? 100.0 * part / whole : 0.0);
  return out;
}

std::string padded(const std::string& s, size_t width, bool right = false) {
  if (s.size() >= width) return s;
  return right ? std::string(width - s.size(), ' ') + s : s + std::string(width - s.size(), ' ');
}

void printTraceSummary(const std::string& file, const Trace& t, size_t top) {
  const TraceSummary s = summarizeTrace(t, top);
  std::cout << "trace:    " << file << " (" << kTraceSchema << ", " << t.meta.createdBy << ")\n"
            << "cluster:  " << t.meta.worldSize << " x " << t.meta.device << ", " << t.meta.backend << ", ZeRO-"
            << t.meta.stage << ", grad accum " << t.meta.gradAccumSteps << ", gather " << t.meta.paramDtype
            << ", reduce " << t.meta.reduceDtype << "\n"
            << "model:    " << s.params << " parameters (" << s.trainableParams << " trainable), " << s.elements
            << " elements, " << formatBytes(s.masterBytes) << " master\n"
            << "memory:   capacity " << formatBytes(t.memory.capacityBytes) << ", baseline "
            << formatBytes(t.memory.baselineBytes) << ", peak recorded " << formatBytes(s.peakMemoryBytes) << "\n\n";

  std::cout << "per step (mean of " << s.steps << " recorded):\n"
            << "  graph  kind       ops  gathers  releases  reduces    gathered     reduced     compute     exposed\n";
  uint64_t gathered = 0, reduced = 0;
  for (const auto& g : s.graphs) {
    gathered += g.gatheredBytes;
    reduced += g.reducedBytes;
    std::cout << "  " << padded(std::to_string(g.id), 5, true) << "  " << padded(graphKindName(g.kind), 8) << " "
              << padded(std::to_string(g.ops), 5, true) << padded(std::to_string(g.gathers), 9, true)
              << padded(std::to_string(g.releases), 10, true) << padded(std::to_string(g.reduces), 9, true)
              << padded(formatBytes(g.gatheredBytes), 12, true) << padded(formatBytes(g.reducedBytes), 12, true)
              << padded(formatMs(g.computeUs), 12, true) << padded(formatMs(g.exposedCommUs), 12, true) << "\n";
  }
  std::cout << "  bytes per step: " << formatBytes(gathered) << " gathered, " << formatBytes(reduced)
            << " reduced\n\n";

  const double total = s.computeUs + s.exposedCommUs + s.optimizerUs;
  std::cout << "time per step: " << formatMs(total) << " = compute " << formatMs(s.computeUs) << " ("
            << percent(s.computeUs, total) << ") + exposed communication " << formatMs(s.exposedCommUs) << " ("
            << percent(s.exposedCommUs, total) << ") + optimizer " << formatMs(s.optimizerUs) << " ("
            << percent(s.optimizerUs, total) << ")\n";
  if (!s.slowest.empty()) {
    std::cout << "\nslowest communication ops:\n"
              << "  step  graph    seq  op                     time       bytes  parameter\n";
    for (const auto& op : s.slowest) {
      std::cout << "  " << padded(std::to_string(op.step), 4, true) << padded(std::to_string(op.graph), 7, true)
                << padded(std::to_string(op.seq), 7, true) << "  " << padded(op.op, 16)
                << padded(formatMs(op.us), 12, true) << padded(formatBytes(op.bytes), 12, true) << "  " << op.param
                << "\n";
    }
  }
}

void runInspect(const InspectOptions& options) {
  auto doc = readJsonFile(options.file);
  if (detectKind(doc, options.file) == DocumentKind::Plan) {
    inspectPlan(doc, options.file, options.plan, std::cout);
    return;
  }
  Trace trace;
  auto diags = validateTrace(doc, trace);
  if (!diags.empty()) throw InputError(options.file, std::move(diags));
  printTraceSummary(options.file, trace, options.top);
}

}  // namespace

void setupInspect(CLI::App& app) {
  auto options = std::make_shared<InspectOptions>();
  auto* cmd = app.add_subcommand("inspect", "Summarise a trace (model, op counts, bytes moved, time split) or a plan (schedule, prediction, per-layer table)");
  cmd->add_option("file", options->file, "trace file")->required();
  cmd->add_option("--top", options->top, "how many of the slowest communication ops to list")
      ->capture_default_str();
  addInspectPlanOptions(*cmd, options->plan);
  cmd->callback([options] { runInspect(*options); });
}

}  // namespace dcplan::cli
