// Names and element sizes of the dtypes that appear in traces and plans.
#pragma once

#include <optional>
#include <string_view>

namespace dcplan::schemas {

/// Element size in bytes of a dtype named as torch names it without "torch."
/// ("float32", "bfloat16", ...); nullopt for a name we do not know.
std::optional<int> dtypeSize(std::string_view name);

/// The accepted names, comma-separated, for error messages.
std::string_view knownDtypeNames();

}  // namespace dcplan::schemas
