// Typed, diagnosing access to the fields of a JSON object: the building block of
// the trace and plan validators. Each getter records a diagnostic naming the
// field's JSON pointer and what was expected, and returns nullopt on a problem.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dcplan/schemas/io.h"
#include "dcplan/schemas/trace.h"
#include "json_pointer.h"

namespace dcplan::schemas {

class Diagnostics {
 public:
  void add(std::string pointer, std::string message) {
    list_.push_back({std::move(pointer), std::move(message)});
  }
  bool empty() const { return list_.empty(); }
  size_t size() const { return list_.size(); }
  std::vector<Diagnostic> take() { return std::move(list_); }

 private:
  std::vector<Diagnostic> list_;
};

/// Describes a JSON value for "got ..." in messages: its type, and short scalars verbatim.
std::string describeValue(const nlohmann::ordered_json& value);

class FieldReader {
 public:
  enum Presence { Required, Optional };

  /// `value` must outlive the reader. Reports a diagnostic if it is not an object.
  FieldReader(const nlohmann::ordered_json& value, std::string pointer, Diagnostics& diags);

  bool isObject() const { return object_; }
  const std::string& pointer() const { return pointer_; }
  std::string pointerOf(const std::string& key) const { return pointer_ + "/" + escapePointerToken(key); }

  std::optional<int64_t> integer(const std::string& key, int64_t min, Presence presence = Required);
  std::optional<uint64_t> bytes(const std::string& key, Presence presence = Required);
  std::optional<double> number(const std::string& key, double min, Presence presence = Required);
  std::optional<double> positiveNumber(const std::string& key, Presence presence = Required);
  std::optional<std::string> string(const std::string& key, Presence presence = Required);
  std::optional<std::string> oneOf(const std::string& key, const std::vector<std::string>& allowed,
                                   Presence presence = Required);
  std::optional<std::string> dtype(const std::string& key, Presence presence = Required);
  std::optional<bool> boolean(const std::string& key, Presence presence = Required);
  /// An array field; nullptr (with a diagnostic when required) if absent or not an array.
  const nlohmann::ordered_json* array(const std::string& key, Presence presence = Required);
  const nlohmann::ordered_json* object(const std::string& key, Presence presence = Required);
  std::optional<std::vector<int64_t>> integers(const std::string& key, int64_t min,
                                               Presence presence = Required);

  /// A graph's optional "input_shapes" (arrays of integers >= 0), which only a forward graph may
  /// have (a diagnostic for a backward's).
  std::optional<InputShapes> inputShapes(GraphKind kind);

  /// Reports every field that no getter asked for.
  void rejectUnknownFields();

 private:
  const nlohmann::ordered_json* find(const std::string& key, Presence presence);

  const nlohmann::ordered_json& value_;
  std::string pointer_;
  Diagnostics& diags_;
  bool object_;
  std::set<std::string> seen_;
};

/// Reads an integer array element (no key). Used for lists like "shape".
std::optional<int64_t> readInteger(const nlohmann::ordered_json& value, const std::string& pointer,
                                   int64_t min, Diagnostics& diags);

}  // namespace dcplan::schemas
