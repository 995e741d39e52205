// `dcplan validate FILE...`: checks traces and plans against their schema.
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dcplan/schemas/io.h"
#include "dcplan/schemas/network.h"
#include "subcommands.h"

namespace dcplan::cli {
namespace {

struct ValidateOptions {
  std::vector<std::string> files;
  bool quiet = false;
};

// Prints one line per problem; returns whether the file is valid.
bool validateFile(const std::string& file, bool quiet) {
  using namespace dcplan::schemas;
  try {
    auto doc = readJsonFile(file);
    std::vector<Diagnostic> diags;
    std::string summary;
    const DocumentKind kind = detectKind(doc, file);
    if (kind == DocumentKind::Trace) {
      Trace trace;
      diags = validateTrace(doc, trace);
      summary = std::string("valid ") + kTraceSchema + " (" + std::to_string(trace.params.size()) +
                " params, " + std::to_string(trace.steps.size()) +
                (trace.steps.size() == 1 ? " step)" : " steps)");
    } else if (kind == DocumentKind::Network) {
      Network network;
      diags = validateNetwork(doc, network);
      summary = std::string("valid ") + kNetworkSchema + " (" + std::to_string(network.worldSize) +
                " ranks, " + network.backend + ")";
    } else {
      Plan plan;
      diags = validatePlan(doc, plan);
      summary = std::string("valid ") + kPlanSchema + " (" + plan.options.strategy + ", " +
                std::to_string(plan.persistent.size()) + " persistent)";
    }
    for (const auto& d : diags) std::cerr << "dcplan: error: " << file << ": " << d.str() << "\n";
    if (diags.empty() && !quiet) std::cout << file << ": " << summary << "\n";
    return diags.empty();
  } catch (const InputError& e) {
    std::cerr << "dcplan: error: " << e.what() << "\n";
    return false;
  }
}

void runValidate(const ValidateOptions& options) {
  bool allValid = true;
  for (const auto& file : options.files) allValid = validateFile(file, options.quiet) && allValid;
  if (!allValid) throw ExitCode{kExitBadInput};
}

}  // namespace

void setupValidate(CLI::App& app) {
  auto options = std::make_shared<ValidateOptions>();
  auto* cmd = app.add_subcommand(
      "validate", "Check traces, plans and network files against their schema (exit 2 on a problem)");
  cmd->add_option("files", options->files,
                  "trace, plan or network files (kind detected from their \"schema\" field)")
      ->required();
  cmd->add_flag("-q,--quiet", options->quiet, "print nothing for valid files");
  cmd->callback([options] { runValidate(*options); });
}

}  // namespace dcplan::cli
