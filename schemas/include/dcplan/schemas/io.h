// Reading, validating and writing traces and plans.
#pragma once

#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "dcplan/schemas/plan.h"
#include "dcplan/schemas/trace.h"

namespace dcplan::schemas {

/// One problem found in a document: where (RFC 6901 JSON pointer) and what.
struct Diagnostic {
  std::string pointer;
  std::string message;
  std::string str() const;  ///< "<pointer>: <message>", or the message alone at the root
};

/// Bad input: a file that is missing, not JSON, or not a valid document.
/// what() is one line: "<file>: <first problem>".
class InputError : public std::runtime_error {
 public:
  InputError(std::string file, std::vector<Diagnostic> diagnostics);
  const std::string& file() const { return file_; }
  const std::vector<Diagnostic>& diagnostics() const { return diagnostics_; }

 private:
  std::string file_;
  std::vector<Diagnostic> diagnostics_;
};

enum class DocumentKind { Trace, Plan, Network };

/// Reads a file and parses it as JSON; rejects duplicate object keys.
/// Throws InputError naming the file.
nlohmann::ordered_json readJsonFile(const std::filesystem::path& path);

/// Parses JSON text; `name` is used in errors.
nlohmann::ordered_json parseJson(std::string_view text, const std::string& name);

/// The kind named by the document's "schema" field; throws InputError when it is
/// missing or names an unknown schema or version.
DocumentKind detectKind(const nlohmann::ordered_json& doc, const std::string& name);

/// Checks a document against its schema and its cross-references. Fills `out`
/// when there is no problem. Returns every problem found.
std::vector<Diagnostic> validateTrace(const nlohmann::ordered_json& doc, Trace& out);
std::vector<Diagnostic> validatePlan(const nlohmann::ordered_json& doc, Plan& out);

/// Read + validate; throws InputError listing every problem.
Trace readTrace(const std::filesystem::path& path);
Plan readPlan(const std::filesystem::path& path);

/// Deterministic serialisation: same model, same bytes (2-space indent, newline at end).
std::string writeTrace(const Trace& trace);
std::string writePlan(const Plan& plan);

/// Writes `content` to a temporary file beside `path` and renames it into place.
/// Throws std::runtime_error naming the file on failure; leaves no partial file.
void writeFileAtomically(const std::filesystem::path& path, std::string_view content);

/// Hash of the parameter table (ids, names, shapes, dtypes) and a world size:
/// "fnv1a64:<16 hex digits>". docs/formats.md gives the exact byte string hashed.
std::string paramSignature(const std::vector<TraceParam>& params, int64_t worldSize);

/// Hash of writeTrace(trace): identifies the trace a plan was made from.
std::string traceDigest(const Trace& trace);

}  // namespace dcplan::schemas
