// The budget guard's switch, its turn at a kept copy's release, and what it tells Python (its
// rule is in BudgetGuard.h, its turn at each planned prefetch in OpEntryPoints.cpp).
#include "RuntimeState.h"

#include <cstdio>
#include <utility>

namespace dcplan::replayer {

namespace {

std::string mib(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MiB", static_cast<double>(bytes) / 1048576.0);
  return text;
}

}  // namespace

void setBudgetGuard(std::optional<int64_t> budgetBytes, int64_t startBytes) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("set_budget_guard");
  if (!budgetBytes) {
    rt.guard_.reset();
    return;
  }
  TORCH_CHECK(*budgetBytes > 0, "set_budget_guard: the budget should be positive, got ", *budgetBytes);
  TORCH_CHECK(startBytes >= 0, "set_budget_guard: start_bytes should be >= 0, got ", startBytes);
  rt.guard_ = BudgetGuard{*budgetBytes, startBytes, -1, false, std::string()};
}

void setBudgetGuardExcess(int64_t excessBytes) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("set_budget_guard_excess");
  TORCH_CHECK(rt.guard_, "set_budget_guard_excess: no budget guard is set (a plan with a budget sets it)");
  TORCH_CHECK(excessBytes >= 0, "set_budget_guard_excess: the excess should be >= 0, got ", excessBytes);
  rt.guard_->excessBytes = excessBytes;
}

std::string takeBudgetGuardNote() {
  std::lock_guard<std::mutex> lock(gMutex);
  auto& rt = state("budget_guard_note");
  return rt.guard_ ? std::exchange(rt.guard_->note, std::string()) : std::string();
}

bool guarding(const RuntimeState& rt) { return rt.guard_ && !rt.capturing_ && !rt.transport_->capturing(); }

void noteHold(RuntimeState& rt, const std::string& what, int64_t peakBytes) {
  BudgetGuard& guard = *rt.guard_;
  if (std::exchange(guard.noted, true)) return;
  guard.note = "dcplan: " + what + " was held back to keep the plan's memory budget of " +
               mib(guard.budgetBytes) + ": the ranks hold up to " + mib(guard.excessBytes) +
               " more than the plan expects at a step's start, and the plan holds up to " + mib(peakBytes) +
               " until the parameters are used. Such parameters are gathered when used instead (slower). A "
               "replay log (DCPLAN_REPLAY_LOG) and `dcplan check` list every hold";
}

bool guardDropsKept(RuntimeState& rt, int64_t graphId, Param& p) {
  if (!guarding(rt)) return false;
  const int64_t peak = rt.schedule_->keptPeak(p.id_);
  if (!holdsBack(*rt.guard_, peak)) return false;
  noteHold(rt, "the copy of " + p.label() + " the plan keeps gathered", peak);
  const BudgetGuard& guard = *rt.guard_;
  rt.schedule_->onGuardHold(
      graphId, SchedulePolicy::GuardHold{
                   "keep", {p.id_}, p.gatheredBytes(), peak, guard.excessBytes, guard.budgetBytes});
  return true;
}

}  // namespace dcplan::replayer
