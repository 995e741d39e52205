// JSON pointer helpers shared by the parser and the validators.
#pragma once

#include <string>
#include <string_view>

namespace dcplan::schemas {

/// Escapes one reference token of an RFC 6901 JSON pointer ("~" -> "~0", "/" -> "~1").
std::string escapePointerToken(std::string_view token);

}  // namespace dcplan::schemas
