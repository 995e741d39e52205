// `dcplan check PLAN LOG... [--trace TRACE [--chrome-trace OUT.json]]`: did each rank follow the plan, and
// how did its prediction hold? The replay logs are read by the runtime's own checker (python -m
// dcplan.check_replay, which holds the rules of a replay); with --trace this command first simulates the
// plan on the trace (the memory and host time of each op, as `inspect --memory-curve` writes them).
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "child_process.h"
#include "dcplan/planner/report.h"
#include "dcplan/schemas/io.h"
#include "subcommands.h"

namespace dcplan::cli {
namespace {

namespace fs = std::filesystem;

struct CheckOptions {
  std::string plan;
  std::vector<std::string> logs;
  std::string trace;
  std::string chromeTrace;
};

/// The interpreter that runs the checker: $DCPLAN_PYTHON, else the python3 beside this executable
/// (a virtual environment's bin, where `pip install .` puts both), else python3 on PATH.
std::string checkerPython() {
  if (const char* env = std::getenv("DCPLAN_PYTHON"); env != nullptr && *env != '\0') return env;
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path beside = self.parent_path() / "python3";
    if (::access(beside.c_str(), X_OK) == 0) return beside.string();
  }
  return "python3";
}

/// The plan simulated on the trace, op by op, in a temporary file removed with this object.
class TemporaryCurve {
 public:
  TemporaryCurve(const schemas::Plan& plan, const CheckOptions& o) {
    schemas::Trace trace = schemas::readTrace(o.trace);
    std::string curve;
    try {
      curve = planner::renderMemoryCurve(plan, o.plan, trace);
    } catch (const std::invalid_argument& e) {
      // The plan does not fit the trace: name the plan, the pointer is into it.
      throw schemas::InputError(o.plan, {{"", std::string(e.what()) + " (trace " + o.trace + ")"}});
    }
    // Named after the plan (the checker's reports name the curve), in a new directory of its own.
    std::string dir = (fs::temp_directory_path() / "dcplan-check-XXXXXX").string();
    if (::mkdtemp(dir.data()) == nullptr) {
      throw std::runtime_error("cannot create a temporary directory " + dir + ": " + std::strerror(errno));
    }
    dir_ = dir;
    path_ = dir_ / (fs::path(o.plan).stem().string() + ".curve.json");
    try {
      schemas::writeFileAtomically(path_, curve);
    } catch (...) {
      removeDir();
      throw;
    }
  }
  ~TemporaryCurve() { removeDir(); }
  TemporaryCurve(const TemporaryCurve&) = delete;
  TemporaryCurve& operator=(const TemporaryCurve&) = delete;
  const fs::path& path() const { return path_; }

 private:
  void removeDir() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  fs::path dir_;
  fs::path path_;
};

void runCheck(const CheckOptions& o) {
  if (!o.chromeTrace.empty() && o.trace.empty()) {
    throw std::invalid_argument("--chrome-trace needs --trace TRACE: the predicted timeline is simulated on "
                                "the trace");
  }
  // A bad plan is named here, in the CLI's words, before the checker starts.
  const schemas::Plan plan = schemas::readPlan(o.plan);
  std::optional<TemporaryCurve> curve;
  if (!o.trace.empty()) curve.emplace(plan, o);
  const std::string python = checkerPython();
  std::vector<std::string> argv = {python, "-m", "dcplan.check_replay", o.plan};
  argv.insert(argv.end(), o.logs.begin(), o.logs.end());
  if (curve) argv.insert(argv.end(), {"--curve", curve->path().string()});
  if (!o.chromeTrace.empty()) argv.insert(argv.end(), {"--chrome-trace", o.chromeTrace});

  InterruptGuard interrupts;
  bool noPackage = false;
  auto onLine = [&](const std::string& line) {
    noPackage = noPackage || line.find("No module named dcplan") != std::string::npos ||
                line.find("No module named 'dcplan'") != std::string::npos;
    std::cout << line << "\n";
  };
  std::optional<ChildStatus> status;
  try {
    ChildProcess child(argv, {});
    while (!(status = child.poll(std::chrono::milliseconds(200), onLine))) {
      if (int signal = interrupts.received()) {
        child.stop(std::chrono::seconds(2));
        throw ExitCode{128 + signal};
      }
    }
  } catch (const std::runtime_error& e) {  // the interpreter could not be started
    throw std::runtime_error(std::string(e.what()) + " (the checker's Python; set DCPLAN_PYTHON)");
  }
  std::cout.flush();
  if (noPackage) {
    std::cerr << "dcplan: error: check reads the replay logs with the dcplan Python package, which " << python
              << " cannot import: install it (pip install .), or set DCPLAN_PYTHON to the interpreter that "
                 "trains with dcplan\n";
    throw ExitCode{kExitBadInput};
  }
  if (!status->ok()) throw ExitCode{status->exited ? status->exitCode : 128 + status->signal};
}

}  // namespace

void setupCheck(CLI::App& app) {
  auto o = std::make_shared<CheckOptions>();
  auto* cmd = app.add_subcommand("check",
                                 "Did each rank follow the plan, and how did the prediction hold? (exit 0 "
                                 "followed, 1 departed or over the budget, 2 error)");
  cmd->add_option("plan", o->plan, "the plan the run loaded")->required();
  cmd->add_option("logs", o->logs, "the ranks' replay logs (DCPLAN_REPLAY_LOG)")->required();
  cmd->add_option("--trace", o->trace,
                  "the plan's trace: also compare each op's simulated memory and host time with each rank's");
  cmd->add_option("--chrome-trace", o->chromeTrace,
                  "with --trace: write the predicted and each rank's measured host timeline as Chrome trace "
                  "events");
  cmd->callback([o] { runCheck(*o); });
}

}  // namespace dcplan::cli
