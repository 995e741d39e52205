// The budget guard: a plan's choice that would hold a copy ahead of its use where that takes the
// rank over the plan's budget (a prefetch, a persistent copy kept) is not taken.
#pragma once

#include "dcplan/replayer/Plan.h"

#include <cstdint>
#include <string>

namespace dcplan::replayer {

/// The budget guard of a replay (setBudgetGuard): the plan's budget and the memory it expects as
/// the step's first op is entered, what the ranks agreed the run holds beyond that, and whether a
/// hold was noted for Python's warning.
struct BudgetGuard {
  int64_t budgetBytes = 0;
  int64_t startBytes = 0;
  int64_t excessBytes = -1;  // -1: not agreed yet (the guard holds nothing back until then)
  bool noted = false;        // the first hold's note was written (Python warns once)
  std::string note;          // that note, until Python takes it
};

/// The rule: a choice whose planned peak (-1: the plan gives none) plus the agreed excess would
/// exceed the budget is not taken. Every rank decides alike: the plan and the excess are the same.
inline bool holdsBack(const BudgetGuard& guard, int64_t peakBytes) {
  return guard.excessBytes >= 0 && peakBytes >= 0 && peakBytes + guard.excessBytes > guard.budgetBytes;
}

struct RuntimeState;
struct Param;

/// Whether the guard acts now: a guard is set and no CUDA graph is being captured (a captured
/// graph keeps what its capture did).
bool guarding(const RuntimeState& rt);

/// The guard's turn at a release where the plan keeps p gathered (its keptPeak): true where it
/// drops the copy instead (logged, noted).
bool guardDropsKept(RuntimeState& rt, int64_t graphId, Param& p);

/// At the first hold, writes the note Python warns with: `what` was held back.
void noteHold(RuntimeState& rt, const std::string& what, int64_t peakBytes);

}  // namespace dcplan::replayer
