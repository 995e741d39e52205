// `dcplan record -o TRACE -- COMMAND...`: runs a training command with recording on,
// shows progress, stops it after the recorded steps, merges and checks the rank traces.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "child_process.h"
#include "dcplan/schemas/io.h"
#include "dcplan/schemas/trace_merge.h"
#include "subcommands.h"
#include "trace_report.h"

namespace dcplan::cli {
namespace {

namespace fs = std::filesystem;
using namespace dcplan::schemas;

struct RecordOptions {
  std::string output;
  int64_t steps = 3;
  int64_t warmup = 2;
  double timeoutS = 0;
  bool verbose = false;
  bool keepRankTraces = false;
  size_t top = 5;
  std::vector<std::string> command;
};

constexpr size_t kLastLines = 20;
constexpr size_t kFirstErrors = 5;

// The command's output as a failure shows it: its last lines, and before them the first lines
// that name an error where those scrolled out (torchrun ends a failed job with a report of its
// own, which pushes the rank's error out of the last lines: a script path it could not open, a
// ValueError of the script's arguments).
class CommandOutput {
 public:
  void add(const std::string& line) {
    static const std::regex error(R"((\w+(Error|Exception)|\berror): |can't open file)");
    ++lines_;
    const bool again = std::any_of(firstErrors_.begin(), firstErrors_.end(),
                                   [&](const auto& kept) { return kept.second == line; });  // another rank's
    if (firstErrors_.size() < kFirstErrors && !again && std::regex_search(line, error))
      firstErrors_.emplace_back(lines_, line);
    last_.push_back(line);
    if (last_.size() > kLastLines) last_.pop_front();
  }

  void print(std::ostream& s) const {
    const size_t firstShown = lines_ - last_.size() + 1;  // the number of the first of last_
    bool headed = false;
    for (const auto& [number, line] : firstErrors_) {
      if (number >= firstShown) break;
      if (!headed) s << "first errors in the command's output:\n";
      headed = true;
      s << "  | " << line << "   (line " << number << ")\n";
    }
    if (last_.empty()) return;
    s << "last output of the command:\n";
    for (const auto& line : last_) s << "  | " << line << "\n";
  }

 private:
  size_t lines_ = 0;
  std::deque<std::string> last_;
  std::vector<std::pair<size_t, std::string>> firstErrors_;  // (line number from 1, line)
};

// Removes the rank directory on every way out, unless asked to keep it.
class RankDirectory {
 public:
  RankDirectory(fs::path path, bool keep) : path_(std::move(path)), keep_(keep) {
    std::error_code ec;
    fs::remove_all(path_, ec);
    if (!fs::create_directories(path_, ec)) {
      throw std::runtime_error(path_.string() +
                               ": cannot create the directory for rank traces: " + ec.message());
    }
  }
  ~RankDirectory() {
    std::error_code ec;
    if (!keep_) fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
  bool keep_;
};

// Reads the ranks' progress files ("<recorded> <total> <world size>"): how many steps the
// slowest rank has recorded, and how many ranks have started recording.
struct Progress {
  int64_t ranks = 0;
  int64_t worldSize = 0;
  int64_t recorded = 0;
  int64_t total = 0;
  bool operator==(const Progress&) const = default;
};

Progress readProgress(const fs::path& dir) {
  static const std::regex name(R"(rank(\d+)\.progress)");
  Progress p;
  int64_t slowest = -1;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (!std::regex_match(entry.path().filename().string(), name)) continue;
    std::ifstream in(entry.path());
    int64_t recorded = 0, total = 0, worldSize = 0;
    if (!(in >> recorded >> total >> worldSize)) continue;  // being rewritten
    ++p.ranks;
    p.total = total;
    p.worldSize = worldSize;
    slowest = slowest < 0 ? recorded : std::min(slowest, recorded);
  }
  p.recorded = std::max<int64_t>(slowest, 0);
  return p;
}

std::string quoteCommand(const std::vector<std::string>& argv) {
  std::string out;
  for (const auto& a : argv) {
    out += out.empty() ? "" : " ";
    out += a.find_first_of(" \t'\"") == std::string::npos ? a : "'" + a + "'";
  }
  return out;
}

[[noreturn]] void failWithOutput(const std::string& message, const CommandOutput& output) {
  std::cerr << "dcplan: error: " << message << "\n";
  output.print(std::cerr);
  std::cerr << "no trace written\n";
  throw ExitCode{kExitBadInput};
}

std::vector<RankTrace> readRankTraces(const fs::path& dir) {
  static const std::regex name(R"(rank(\d+)\.trace\.json)");
  std::vector<RankTrace> ranks;
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir)) files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  for (const auto& file : files) {
    std::smatch m;
    const std::string base = file.filename().string();
    if (!std::regex_match(base, m, name)) continue;
    ranks.push_back({std::stoll(m[1]), file.string(), readTrace(file)});
  }
  return ranks;
}

void runRecord(const RecordOptions& o) {
  const fs::path output = o.output;
  const fs::path rankDir = output.string() + ".ranks";
  RankDirectory ranks(rankDir, o.keepRankTraces);
  const std::map<std::string, std::string> env{{"DCPLAN_RECORD", fs::absolute(rankDir).string()},
                                               {"DCPLAN_RECORD_STEPS", std::to_string(o.steps)},
                                               {"DCPLAN_RECORD_WARMUP", std::to_string(o.warmup)}};
  std::cerr << "dcplan record: running " << quoteCommand(o.command) << "\n"
            << "dcplan record: recording " << o.steps << " steps after " << o.warmup << " warm-up steps into "
            << rankDir.string() << "/\n";

  InterruptGuard interrupts;
  ChildProcess child(o.command, env);
  CommandOutput commandOutput;
  auto onLine = [&](const std::string& line) {
    // The recorder's own warnings (a trace without device_us, say) are shown without -v too.
    if (o.verbose || line.find("Warning: record: ") != std::string::npos) std::cerr << line << "\n";
    commandOutput.add(line);
  };
  const auto started = std::chrono::steady_clock::now();
  Progress shown;
  std::optional<ChildStatus> status;
  while (!(status = child.poll(std::chrono::milliseconds(200), onLine))) {
    if (int signal = interrupts.received()) {
      std::cerr << "dcplan record: " << strsignal(signal) << ": stopping the command\n";
      child.stop(std::chrono::seconds(5));
      std::cerr << "dcplan: error: interrupted: no trace written\n";
      throw ExitCode{128 + signal};
    }
    if (o.timeoutS > 0 &&
        std::chrono::steady_clock::now() - started > std::chrono::duration<double>(o.timeoutS)) {
      child.stop(std::chrono::seconds(5));
      failWithOutput("the command did not finish recording within " +
                         std::to_string(static_cast<int64_t>(o.timeoutS)) + " s (--timeout)", commandOutput);
    }
    Progress p = readProgress(rankDir);
    if (p.ranks > 0 && !(p == shown)) {
      std::cerr << "dcplan record: step " << p.recorded << "/" << p.total << " recorded on " << p.ranks << "/"
                << p.worldSize << " ranks\n";
      shown = p;
    }
  }
  if (!status->ok()) {
    failWithOutput("the command failed (" + status->describe() + "): " + quoteCommand(o.command),
                   commandOutput);
  }
  std::vector<RankTrace> rankTraces = readRankTraces(rankDir);
  if (rankTraces.empty()) {
    // A rank writes its trace at the forward after its last recorded step, once that step's
    // optimizer time is known (docs/recording.md): a job must run one step more than it records.
    const std::string needed = std::to_string(o.warmup + o.steps + 1) + " steps (" +
                               std::to_string(o.warmup) + " warm-up, " + std::to_string(o.steps) +
                               " recorded and 1 more, at whose forward the trace is written)";
    const Progress p = readProgress(rankDir);
    if (p.ranks > 0 && p.ranks == p.worldSize && p.total > 0 && p.recorded >= p.total) {
      failWithOutput("the command finished without writing a trace: every rank recorded its " +
                         std::to_string(p.total) +
                         " steps, but the job ended before the next forward; run at least " + needed,
                     commandOutput);
    }
    if (p.ranks > 0) {
      failWithOutput("the command finished after recording " + std::to_string(p.recorded) + " of " +
                         std::to_string(p.total) + " steps; run at least " + needed,
                     commandOutput);
    }
    failWithOutput("the command finished without recording: no rank traces in " + rankDir.string() +
                       "/ (does it call dcplan.shard() and run at least " + needed + "?)", commandOutput);
  }
  Trace merged;
  try {
    merged = mergeRankTraces(rankTraces);
  } catch (const InputError& e) {
    std::cerr << "dcplan: error: " << e.what() << "\n";
    if (!o.keepRankTraces) std::cerr << "the rank traces were removed; --keep-rank-traces keeps them\n";
    std::cerr << "no trace written\n";
    throw ExitCode{kExitBadInput};
  }
  // Re-validate what we are about to write: a merge must never produce a bad trace.
  const std::string text = writeTrace(merged);
  Trace check;
  if (auto diags = validateTrace(parseJson(text, output.string()), check); !diags.empty()) {
    throw InputError(output.string(), std::move(diags));
  }
  writeFileAtomically(output, text);
  std::cerr << "dcplan record: merged " << rankTraces.size() << " rank traces into " << output.string()
            << "\n\n";
  printTraceSummary(std::cout, output.string(), merged, o.top);
}

}  // namespace

void setupRecord(CLI::App& app) {
  auto o = std::make_shared<RecordOptions>();
  auto* cmd =
      app.add_subcommand("record", "Run a training command with recording on and write its merged trace");
  cmd->add_option("-o,--output", o->output, "trace file to write")->required();
  cmd->add_option("--steps", o->steps, "steps to record")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  cmd->add_option("--warmup", o->warmup, "steps to run before recording")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  cmd->add_option("--timeout", o->timeoutS, "stop the command after this many seconds (0: no limit)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--top", o->top, "slowest ops listed in the summary")->capture_default_str();
  cmd->add_flag("-v,--verbose", o->verbose, "show the command's output as it runs");
  cmd->add_flag("--keep-rank-traces", o->keepRankTraces, "keep the per-rank traces in OUTPUT.ranks/");
  cmd->add_option("command", o->command,
                  "training command, after --, e.g. -- torchrun --nproc-per-node 2 train.py")
      ->required();
  cmd->footer(
      "The command runs with DCPLAN_RECORD=<OUTPUT>.ranks, DCPLAN_RECORD_STEPS and DCPLAN_RECORD_WARMUP "
      "set;\n"
      "each rank writes rank<N>.trace.json there and ends after the recorded steps (docs/recording.md).");
  cmd->callback([o] { runRecord(*o); });
}

}  // namespace dcplan::cli
