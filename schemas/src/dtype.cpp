// Element sizes of the dtypes named in traces and plans.
#include "dcplan/schemas/dtype.h"

#include <array>
#include <utility>

namespace dcplan::schemas {
namespace {

constexpr std::array<std::pair<std::string_view, int>, 11> kDtypes{{
    {"float32", 4},
    {"float16", 2},
    {"bfloat16", 2},
    {"float64", 8},
    {"float8_e4m3fn", 1},
    {"float8_e5m2", 1},
    {"int64", 8},
    {"int32", 4},
    {"int8", 1},
    {"uint8", 1},
    {"bool", 1},
}};

}  // namespace

std::optional<int> dtypeSize(std::string_view name) {
  for (const auto& [known, size] : kDtypes) {
    if (known == name) return size;
  }
  return std::nullopt;
}

std::string_view knownDtypeNames() {
  return "float32, float16, bfloat16, float64, float8_e4m3fn, float8_e5m2, int64, int32, int8, "
         "uint8, bool";
}

}  // namespace dcplan::schemas
