// Step times of a replay log (see replay_log.h).
#include "dcplan/schemas/replay_log.h"

#include <algorithm>
#include <fstream>

#include <nlohmann/json.hpp>

#include "dcplan/schemas/io.h"

namespace dcplan::schemas {

std::vector<int64_t> stepStarts(const std::vector<ReplayLogEvent>& events) {
  std::vector<int64_t> starts;
  bool newStep = true;
  for (const ReplayLogEvent& e : events) {
    if (e.ev == "mark" && e.grad && newStep) {
      starts.push_back(e.tUs);
      newStep = false;
    } else if (e.ev == "start_backward") {
      newStep = e.sync;  // an optimizer step ends with a synchronizing backward
    }
  }
  return starts;
}

MeasuredSteps measuredSteps(const std::vector<int64_t>& starts) {
  std::vector<double> gaps;
  for (size_t i = 2; i < starts.size(); ++i) gaps.push_back(static_cast<double>(starts[i] - starts[i - 1]));
  MeasuredSteps m;
  m.count = static_cast<int64_t>(gaps.size());
  if (!gaps.empty()) m.medianUs = medianOf(gaps);
  return m;
}

double medianOf(std::vector<double>& values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

std::optional<double> graphStepUs(std::vector<double> replayUs) {
  if (static_cast<int64_t>(replayUs.size()) < 1 + kGraphTimedReplays) return std::nullopt;
  replayUs.erase(replayUs.begin());  // the first uploads the graph
  return medianOf(replayUs);
}

MeasuredGraphReplays measuredGraphReplays(const std::vector<ReplayLogEvent>& events) {
  std::vector<double> replayUs;
  for (const ReplayLogEvent& e : events) {
    if (e.ev == "graph_capture") replayUs.clear();  // captured again: the step is the last capture's
    if (e.ev == "graph_replay") replayUs.push_back(e.deviceUs);
  }
  MeasuredGraphReplays m;
  m.replays = static_cast<int64_t>(replayUs.size());
  m.stepUs = graphStepUs(std::move(replayUs));
  return m;
}

ReplayLog readReplayLog(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InputError(path, {{"", "cannot open the replay log"}});
  ReplayLog log;
  log.path = path;
  std::vector<ReplayLogEvent> events;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("ev") || !j["ev"].is_string()) {
      throw InputError(path,
                       {{"", "line " + std::to_string(number) +
                                 ": expected a JSON object with \"ev\" (a replay log, docs/replay.md)"}});
    }
    ReplayLogEvent e;
    e.ev = j["ev"].get<std::string>();
    if (j.contains("t_us") && j["t_us"].is_number()) e.tUs = j["t_us"].get<int64_t>();
    if (j.contains("sync") && j["sync"].is_boolean()) e.sync = j["sync"].get<bool>();
    if (j.contains("grad") && j["grad"].is_boolean()) e.grad = j["grad"].get<bool>();
    if (e.ev == "plan" && j.contains("file") && j["file"].is_string())
      log.planFile = j["file"].get<std::string>();
    if (e.ev == "plan" && j.contains("rank") && j["rank"].is_number_integer() && j.contains("world_size") &&
        j["world_size"].is_number_integer()) {
      log.rank = j["rank"].get<int>();
      log.worldSize = j["world_size"].get<int>();
    }
    if (e.ev == "graph_replay") {
      if (!j.contains("device_us") || !j["device_us"].is_number() || !(j["device_us"].get<double>() > 0)) {
        throw InputError(path, {{"", "line " + std::to_string(number) +
                                         ": a graph_replay line needs device_us, a number > 0 (docs/replay.md)"}});
      }
      e.deviceUs = j["device_us"].get<double>();
    }
    events.push_back(std::move(e));
  }
  log.steps = measuredSteps(stepStarts(events));
  log.graph = measuredGraphReplays(events);
  return log;
}

}  // namespace dcplan::schemas
