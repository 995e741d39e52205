// Typed, diagnosing access to the fields of a JSON object.
#include "field_reader.h"

#include <cmath>
#include <limits>

#include "dcplan/schemas/dtype.h"

namespace dcplan::schemas {

using nlohmann::ordered_json;

std::string describeValue(const ordered_json& value) {
  if (value.is_string()) {
    auto s = value.get<std::string>();
    if (s.size() > 40) s = s.substr(0, 37) + "...";
    return "string " + ordered_json(s).dump();
  }
  if (value.is_number() || value.is_boolean() || value.is_null()) {
    const char* kind = value.is_number_float() ? "number " : value.is_number() ? "integer " : "";
    return kind + value.dump();
  }
  return value.type_name();
}

FieldReader::FieldReader(const ordered_json& value, std::string pointer, Diagnostics& diags)
    : value_(value), pointer_(std::move(pointer)), diags_(diags), object_(value.is_object()) {
  if (!object_) diags_.add(pointer_, "expected an object, got " + describeValue(value));
}

const ordered_json* FieldReader::find(const std::string& key, Presence presence) {
  seen_.insert(key);
  if (!object_) return nullptr;
  auto it = value_.find(key);
  if (it == value_.end()) {
    if (presence == Required) {
      diags_.add(pointer_, "missing required field \"" + key + "\"");
    }
    return nullptr;
  }
  return &*it;
}

std::optional<int64_t> readInteger(const ordered_json& value, const std::string& pointer, int64_t min,
                                   Diagnostics& diags) {
  std::optional<int64_t> result;
  if (value.is_number_integer() && !value.is_number_unsigned()) {
    result = value.get<int64_t>();
  } else if (value.is_number_unsigned()) {
    auto u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      diags.add(pointer, "integer " + value.dump() + " is out of range");
      return std::nullopt;
    }
    result = static_cast<int64_t>(u);
  } else {
    diags.add(pointer, "expected an integer, got " + describeValue(value));
    return std::nullopt;
  }
  if (*result < min) {
    diags.add(pointer, "expected an integer >= " + std::to_string(min) + ", got " + std::to_string(*result));
    return std::nullopt;
  }
  return result;
}

std::optional<int64_t> FieldReader::integer(const std::string& key, int64_t min, Presence presence) {
  const ordered_json* v = find(key, presence);
  if (!v) return std::nullopt;
  return readInteger(*v, pointerOf(key), min, diags_);
}

std::optional<uint64_t> FieldReader::bytes(const std::string& key, Presence presence) {
  auto v = integer(key, 0, presence);
  if (!v) return std::nullopt;
  return static_cast<uint64_t>(*v);
}

std::optional<double> FieldReader::number(const std::string& key, double min, Presence presence) {
  const ordered_json* v = find(key, presence);
  if (!v) return std::nullopt;
  if (!v->is_number()) {
    diags_.add(pointerOf(key), "expected a number, got " + describeValue(*v));
    return std::nullopt;
  }
  double d = v->get<double>();
  if (!std::isfinite(d) || d < min) {
    diags_.add(pointerOf(key), "expected a number >= " + ordered_json(min).dump() + ", got " + v->dump());
    return std::nullopt;
  }
  return d;
}

std::optional<double> FieldReader::positiveNumber(const std::string& key, Presence presence) {
  auto d = number(key, 0, presence);
  if (d && *d <= 0) {
    diags_.add(pointerOf(key), "expected a number > 0, got " + ordered_json(*d).dump());
    return std::nullopt;
  }
  return d;
}

std::optional<std::string> FieldReader::string(const std::string& key, Presence presence) {
  const ordered_json* v = find(key, presence);
  if (!v) return std::nullopt;
  if (!v->is_string()) {
    diags_.add(pointerOf(key), "expected a string, got " + describeValue(*v));
    return std::nullopt;
  }
  return v->get<std::string>();
}

std::optional<std::string> FieldReader::oneOf(const std::string& key, const std::vector<std::string>& allowed,
                                              Presence presence) {
  auto s = string(key, presence);
  if (!s) return std::nullopt;
  for (const auto& a : allowed) {
    if (*s == a) return s;
  }
  std::string list;
  for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + ("\"" + a + "\"");
  diags_.add(pointerOf(key), "expected one of " + list + ", got \"" + *s + "\"");
  return std::nullopt;
}

std::optional<std::string> FieldReader::dtype(const std::string& key, Presence presence) {
  auto s = string(key, presence);
  if (!s) return std::nullopt;
  if (!dtypeSize(*s)) {
    diags_.add(pointerOf(key),
               "unknown dtype \"" + *s + "\" (expected one of " + std::string(knownDtypeNames()) + ")");
    return std::nullopt;
  }
  return s;
}

std::optional<bool> FieldReader::boolean(const std::string& key, Presence presence) {
  const ordered_json* v = find(key, presence);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) {
    diags_.add(pointerOf(key), "expected true or false, got " + describeValue(*v));
    return std::nullopt;
  }
  return v->get<bool>();
}

const ordered_json* FieldReader::array(const std::string& key, Presence presence) {
  const ordered_json* v = find(key, presence);
  if (!v) return nullptr;
  if (!v->is_array()) {
    diags_.add(pointerOf(key), "expected an array, got " + describeValue(*v));
    return nullptr;
  }
  return v;
}

const ordered_json* FieldReader::object(const std::string& key, Presence presence) {
  const ordered_json* v = find(key, presence);
  if (!v) return nullptr;
  if (!v->is_object()) {
    diags_.add(pointerOf(key), "expected an object, got " + describeValue(*v));
    return nullptr;
  }
  return v;
}

std::optional<std::vector<int64_t>> FieldReader::integers(const std::string& key, int64_t min,
                                                          Presence presence) {
  const ordered_json* list = array(key, presence);
  if (!list) return std::nullopt;
  std::vector<int64_t> out;
  bool ok = true;
  for (size_t i = 0; i < list->size(); ++i) {
    auto v = readInteger((*list)[i], pointerOf(key) + "/" + std::to_string(i), min, diags_);
    if (v)
      out.push_back(*v);
    else
      ok = false;
  }
  if (!ok) return std::nullopt;
  return out;
}

std::optional<InputShapes> FieldReader::inputShapes(GraphKind kind) {
  const std::string key = "input_shapes";
  const ordered_json* list = array(key, Optional);
  if (!list) return std::nullopt;
  if (kind != GraphKind::Forward) {
    diags_.add(pointerOf(key), "input shapes belong to forward graphs; this graph is a backward");
    return std::nullopt;
  }
  InputShapes out;
  bool ok = true;
  for (size_t i = 0; i < list->size(); ++i) {
    const std::string ptr = pointerOf(key) + "/" + std::to_string(i);
    const ordered_json& shape = (*list)[i];
    if (!shape.is_array()) {
      diags_.add(ptr, "expected a shape (an array of integers >= 0), got " + describeValue(shape));
      ok = false;
      continue;
    }
    std::vector<int64_t> dims;
    for (size_t d = 0; d < shape.size(); ++d) {
      auto v = readInteger(shape[d], ptr + "/" + std::to_string(d), 0, diags_);
      if (v)
        dims.push_back(*v);
      else
        ok = false;
    }
    out.push_back(std::move(dims));
  }
  if (!ok) return std::nullopt;
  return out;
}

void FieldReader::rejectUnknownFields() {
  if (!object_) return;
  for (const auto& [key, value] : value_.items()) {
    if (!seen_.count(key)) diags_.add(pointerOf(key), "unknown field \"" + key + "\"");
  }
}

}  // namespace dcplan::schemas
