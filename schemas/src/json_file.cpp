// JSON files: strict parsing (duplicate keys refused), schema detection, atomic writes.
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "dcplan/schemas/io.h"
#include "dcplan/schemas/network.h"
#include "json_pointer.h"

namespace dcplan::schemas {

using nlohmann::ordered_json;

std::string Diagnostic::str() const { return pointer.empty() ? message : pointer + ": " + message; }

InputError::InputError(std::string file, std::vector<Diagnostic> diagnostics)
    : std::runtime_error(file + ": " + (diagnostics.empty() ? "invalid input" : diagnostics.front().str())),
      file_(std::move(file)),
      diagnostics_(std::move(diagnostics)) {}

namespace {

// Tracks where the parser is, so that a duplicate key can be named by its JSON pointer.
// nlohmann keeps the last of duplicate keys silently; we refuse them instead.
class DuplicateKeyFinder {
 public:
  bool operator()(int /*depth*/, ordered_json::parse_event_t event, ordered_json& parsed) {
    using Event = ordered_json::parse_event_t;
    switch (event) {
      case Event::object_start:
      case Event::array_start:
        frames_.push_back(Frame{event == Event::array_start, childSegment(), 0, "", {}});
        break;
      case Event::object_end:
      case Event::array_end:
        frames_.pop_back();
        break;
      case Event::key: {
        Frame& top = frames_.back();
        top.key = parsed.get<std::string>();
        if (!top.keys.insert(top.key).second && !duplicate_) {
          duplicate_ =
              Diagnostic{pointer() + "/" + escapePointerToken(top.key), "duplicate key \"" + top.key + "\""};
        }
        break;
      }
      case Event::value:
        childSegment();
        break;
    }
    return true;
  }

  const std::optional<Diagnostic>& duplicate() const { return duplicate_; }

 private:
  struct Frame {
    bool isArray;
    std::string segment;  // this container's token in its parent ("" at the root)
    int64_t nextIndex;
    std::string key;
    std::set<std::string> keys;
  };

  // The token of the value that starts now, inside the current container.
  std::string childSegment() {
    if (frames_.empty()) return "";
    Frame& top = frames_.back();
    if (top.isArray) return std::to_string(top.nextIndex++);
    return escapePointerToken(top.key);
  }

  std::string pointer() const {
    std::string out;
    for (size_t i = 1; i < frames_.size(); ++i) out += "/" + frames_[i].segment;
    return out;
  }

  std::vector<Frame> frames_;
  std::optional<Diagnostic> duplicate_;
};

std::string withoutExceptionTag(const std::string& what) {
  // "[json.exception.parse_error.101] parse error at line 1, ..." -> "parse error at line 1, ..."
  auto close = what.find("] ");
  return close == std::string::npos ? what : what.substr(close + 2);
}

}  // namespace

std::string escapePointerToken(std::string_view token) {
  std::string out;
  for (char c : token) {
    if (c == '~')
      out += "~0";
    else if (c == '/')
      out += "~1";
    else
      out += c;
  }
  return out;
}

ordered_json parseJson(std::string_view text, const std::string& name) {
  if (text.find_first_not_of(" \t\r\n") == std::string_view::npos) {
    throw InputError(name, {{"", "file is empty, expected a JSON document"}});
  }
  DuplicateKeyFinder finder;
  ordered_json doc;
  try {
    doc = ordered_json::parse(text, std::ref(finder));
  } catch (const ordered_json::parse_error& e) {
    throw InputError(name, {{"", "not valid JSON: " + withoutExceptionTag(e.what())}});
  }
  if (finder.duplicate()) throw InputError(name, {*finder.duplicate()});
  return doc;
}

ordered_json readJsonFile(const std::filesystem::path& path) {
  const std::string name = path.string();
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw InputError(name, {{"", "is a directory, expected a JSON file"}});
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(name, {{"", std::string("cannot open: ") + std::strerror(errno)}});
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) throw InputError(name, {{"", "cannot read the file"}});
  return parseJson(buffer.str(), name);
}

DocumentKind detectKind(const ordered_json& doc, const std::string& name) {
  const std::string known =
      "\"" + std::string(kTraceSchema) + "\", \"" + kPlanSchema + "\" or \"" + kNetworkSchema + "\"";
  if (!doc.is_object()) {
    throw InputError(name,
                     {{"", std::string("expected a JSON object at the top level, got ") + doc.type_name()}});
  }
  auto it = doc.find("schema");
  if (it == doc.end()) throw InputError(name, {{"", "missing field \"schema\" (expected " + known + ")"}});
  if (!it->is_string()) {
    throw InputError(name, {{"/schema", std::string("expected a string, got ") + it->type_name()}});
  }
  const auto schema = it->get<std::string>();
  if (schema == kTraceSchema) return DocumentKind::Trace;
  if (schema == kPlanSchema) return DocumentKind::Plan;
  if (schema == kNetworkSchema) return DocumentKind::Network;
  std::string message = "unknown schema \"" + schema + "\"";
  for (const char* family : {"dcplan.trace/", "dcplan.plan/", "dcplan.network/"}) {
    if (schema.rfind(family, 0) == 0) message = "unsupported schema version \"" + schema + "\"";
  }
  throw InputError(name, {{"/schema", message + " (this dcplan reads " + known + ")"}});
}

void writeFileAtomically(const std::filesystem::path& path, std::string_view content) {
  // Write beside the target so the rename stays on one file system.
  std::filesystem::path temp = path;
  temp += ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    if (!out) {
      throw std::runtime_error(path.string() + ": cannot write: " + std::strerror(errno));
    }
    out.write(content.data(), static_cast<std::streamsize>(content.size()));
    out.flush();
    if (!out) {
      std::error_code ignored;
      std::filesystem::remove(temp, ignored);
      throw std::runtime_error(path.string() + ": cannot write: " + std::strerror(errno));
    }
  }
  std::error_code ec;
  std::filesystem::rename(temp, path, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(temp, ignored);
    throw std::runtime_error(path.string() + ": cannot write: " + ec.message());
  }
}

}  // namespace dcplan::schemas
