// Every single-node mutation of a valid trace or plan is diagnosed, never a crash:
// each value replaced by values of every other type, and each field deleted.
#include <functional>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "dcplan/schemas/io.h"

namespace dcplan::schemas {
namespace {

using nlohmann::ordered_json;

// JSON pointers of every node below the root.
void collectPointers(const ordered_json& node, const std::string& at, std::vector<std::string>& out) {
  if (!at.empty()) out.push_back(at);
  if (node.is_object()) {
    for (const auto& [key, child] : node.items()) collectPointers(child, at + "/" + key, out);
  } else if (node.is_array()) {
    for (size_t i = 0; i < node.size(); ++i) collectPointers(node[i], at + "/" + std::to_string(i), out);
  }
}

template <typename Model>
void mutateEverywhere(const std::string& file,
                      const std::function<std::vector<Diagnostic>(const ordered_json&, Model&)>& validate) {
  const ordered_json original = readJsonFile(std::string(DCPLAN_SOURCE_DIR) + "/tests/lit/Inputs/" + file);
  std::vector<std::string> pointers;
  collectPointers(original, "", pointers);
  const std::vector<ordered_json> replacements{
      nullptr, -1, 1e300, "x", true, ordered_json::array(), ordered_json::object(), 18446744073709551615ull};
  size_t diagnosed = 0, accepted = 0;
  for (const auto& pointer : pointers) {
    const ordered_json::json_pointer at(pointer);
    for (const auto& replacement : replacements) {
      ordered_json doc = original;
      if (doc[at] == replacement) continue;
      doc[at] = replacement;
      Model model;
      auto diags = validate(doc, model);
      (diags.empty() ? accepted : diagnosed)++;
      for (const auto& d : diags) EXPECT_FALSE(d.message.empty()) << pointer;
    }
    ordered_json doc = original;
    doc[at.parent_pointer()].is_object() ? (void)doc[at.parent_pointer()].erase(at.back())
                                         : doc[at.parent_pointer()].erase(std::stoul(at.back()));
    Model model;
    (validate(doc, model).empty() ? accepted : diagnosed)++;
  }
  // Almost every mutation must be caught; the few accepted ones are values that stay
  // legal (e.g. a free-form version string, or a time replaced by another time).
  EXPECT_GT(diagnosed, 10 * accepted) << diagnosed << " diagnosed, " << accepted << " accepted";
}

TEST(Mutation, TraceMutationsAreDiagnosedNeverCrash) {
  mutateEverywhere<Trace>("minimal.trace.json",
                          [](const ordered_json& d, Trace& t) { return validateTrace(d, t); });
}

TEST(Mutation, PlanMutationsAreDiagnosedNeverCrash) {
  mutateEverywhere<Plan>("minimal.plan.json",
                         [](const ordered_json& d, Plan& p) { return validatePlan(d, p); });
}

}  // namespace
}  // namespace dcplan::schemas
