// Semantic comparison of two plans: buckets, prefetch groups, persistent set, predictions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dcplan/schemas/plan.h"

namespace dcplan::planner {

enum class Change { Added, Removed, Changed };

/// One difference; `path` is a JSON pointer into the plans where it lies.
struct PlanDifference {
  std::string path;
  Change change = Change::Changed;
  std::string what;  ///< human label, e.g. "graph 0 (forward) prefetch @12"
  std::optional<std::vector<int64_t>> idsA, idsB;
  std::optional<double> numberA, numberB;
  std::string textA, textB;  ///< for values that are neither ids nor numbers
};

struct PlanDiff {
  std::vector<PlanDifference> differences;  ///< what makes the plans differ
  std::vector<PlanDifference> notes;        ///< provenance that does not (trace digest, creator)
  bool equal() const { return differences.empty(); }
};

/// Compares `a` with `b`. Predictions differ when their relative difference is
/// above `tolerance` (0.01 = 1%); everything else must match exactly. Prefetch
/// groups are compared by position, buckets by order.
PlanDiff diffPlans(const schemas::Plan& a, const schemas::Plan& b, double tolerance = 0);

/// Readable report, one difference per line, ending with a summary line.
std::string renderDiffText(const PlanDiff& diff, const std::string& nameA, const std::string& nameB);

/// {"equal": ..., "a": ..., "b": ..., "tolerance": ..., "differences": [...], "notes": [...]}
std::string renderDiffJson(const PlanDiff& diff, const std::string& nameA, const std::string& nameB,
                           double tolerance);

/// "3-6 9 12-13": ids compressed into ranges, in the given order.
std::string formatIds(const std::vector<int64_t>& ids);

}  // namespace dcplan::planner
