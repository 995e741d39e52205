// The dcplan subcommands: each file defines setup<Name>(CLI::App&), which adds the
// subcommand and its options and sets its callback.
#pragma once

#include <CLI/CLI.hpp>

namespace dcplan::cli {

void setupValidate(CLI::App& app);
void setupInspect(CLI::App& app);
void setupPlan(CLI::App& app);
void setupDiff(CLI::App& app);
void setupRecord(CLI::App& app);
void setupCheck(CLI::App& app);

/// Exit codes shared by all subcommands.
inline constexpr int kExitOk = 0;
inline constexpr int kExitDiffers = 1;   ///< diff: the plans differ
inline constexpr int kExitBadInput = 2;  ///< bad input or usage

/// Thrown by a subcommand that has already printed its output and wants `main`
/// to end with `code`.
struct ExitCode {
  int code;
};

}  // namespace dcplan::cli
