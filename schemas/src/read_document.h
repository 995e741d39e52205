// Reading one kind of document: the file, its kind, its validation (trace, plan, network).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dcplan/schemas/io.h"

namespace dcplan::schemas {

/// Reads `path` as a document of `kind` and validates it into a T. `what` names the kind in the
/// error for another document (`a plan ("dcplan.plan/v1")`). Throws InputError naming the file.
template <typename T>
T readDocument(const std::filesystem::path& path, DocumentKind kind, const std::string& what,
               std::vector<Diagnostic> (*validate)(const nlohmann::ordered_json&, T&)) {
  const std::string name = path.string();
  const nlohmann::ordered_json doc = readJsonFile(path);
  if (detectKind(doc, name) != kind) {
    throw InputError(
        name, {{"/schema", "expected " + what + ", got \"" + doc["schema"].get<std::string>() + "\""}});
  }
  T out;
  std::vector<Diagnostic> diags = validate(doc, out);
  if (!diags.empty()) throw InputError(name, std::move(diags));
  return out;
}

}  // namespace dcplan::schemas
