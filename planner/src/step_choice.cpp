// Which recorded step a plan is made from (see step_choice.h).
#include "step_choice.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "dcplan/planner/units.h"

namespace dcplan::planner::detail {

std::optional<double> stepHostUs(const schemas::Trace& trace, const std::vector<size_t>& micro) {
  if (!trace.steps[micro.back()].optimizerHostUs) return std::nullopt;
  double us = *trace.steps[micro.back()].optimizerHostUs;
  for (size_t m : micro) {
    for (const schemas::TraceGraph& g : trace.steps[m].graphs) {
      for (const schemas::OpEvent& e : g.events) {
        if (!e.hostUs || !e.issueUs) return std::nullopt;
        us += *e.hostUs + *e.issueUs;
      }
    }
  }
  return us;
}

std::vector<size_t> microStepsEndingAt(const schemas::Trace& trace, size_t end, int64_t gradAccumSteps) {
  std::vector<size_t> micro{end};
  while (static_cast<int64_t>(micro.size()) < gradAccumSteps && micro.back() > 0 &&
         !(trace.steps[micro.back() - 1].optimizerUs > 0)) {
    micro.push_back(micro.back() - 1);
  }
  std::reverse(micro.begin(), micro.end());
  // Fewer micro-steps recorded than the step has: the first recorded one stands
  // in for the missing ones, so that per-step gather counts stay right.
  while (static_cast<int64_t>(micro.size()) < gradAccumSteps) micro.insert(micro.begin(), micro.front());
  return micro;
}

// What dcplan check measures is the median step of a replay (its first left out), so the plan
// predicts from the median recorded step. On 2 CPU ranks sharing 2 cores, steps of one run vary by
// a quarter (32-58 ms) whatever the schedule; the fastest of the recorded steps predicted 9 replays
// 16% too fast on average (-43..+5%), the median 2% (-34..+33%).
size_t steadyOptimizerStep(const schemas::Trace& trace, int64_t gradAccumSteps, StepReplay replay,
                           std::string& note) {
  std::vector<size_t> ends;
  for (size_t i = 0; i < trace.steps.size(); ++i) {
    if (trace.steps[i].optimizerUs > 0) ends.push_back(i);
  }
  if (ends.empty()) return trace.steps.size() - 1;
  if (ends.size() < 2 || replay == StepReplay::CudaGraph) return ends.back();
  std::vector<std::pair<double, size_t>> hosts;  // host time, step
  for (size_t e : ends) {
    std::vector<size_t> micro = microStepsEndingAt(trace, e, gradAccumSteps);
    // A step with fewer recorded micro-steps than it has (the first, recorded part-way) would look
    // fast: compare complete steps only.
    if (std::adjacent_find(micro.begin(), micro.end()) != micro.end()) continue;
    std::optional<double> us = stepHostUs(trace, micro);
    if (!us) return ends.back();
    hosts.emplace_back(*us, e);
  }
  if (hosts.size() < 2) return ends.back();
  std::vector<std::pair<double, size_t>> sorted = hosts;
  std::sort(sorted.begin(), sorted.end());
  if (sorted.back().first <= sorted.front().first * (1.0 + kStepsAgreeShare)) return ends.back();
  const size_t chosen = sorted[(sorted.size() - 1) / 2].second;  // of an even count, the faster middle
  std::string times;
  for (const auto& [us, e] : hosts) {
    times += (times.empty() ? "" : ", ") + formatFixed(us / 1000, 1) + " ms (step " +
             std::to_string(trace.steps[e].index) + ")";
  }
  note = "the recorded optimizer steps disagree on host time by more than " +
         formatFixed(100 * kStepsAgreeShare, 0) + "%: " + times + "; planned from step " +
         std::to_string(trace.steps[chosen].index) + ", the median" +
         (chosen == ends.back() ? "" : ", not the last") +
         "; record more steps (dcplan record --steps) for a steadier median, and more warm-up steps "
         "(--warmup) where the machine is still warming up";
  return chosen;
}

}  // namespace dcplan::planner::detail
