// Human-readable sizes and times.
#include "dcplan/schemas/units.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace dcplan::schemas {

std::string formatBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 5) {
    value /= 1024;
    ++unit;
  }
  char out[32];
  std::snprintf(out, sizeof out,
                value < 10    ? "%.2f %s"
                : value < 100 ? "%.1f %s"
                              : "%.0f %s",
                value, kUnits[unit]);
  return out;
}

std::string formatMs(double us) {
  char out[32];
  std::snprintf(out, sizeof out, "%.3f ms", us / 1000.0);
  return out;
}

std::optional<uint64_t> parseByteSize(std::string_view text) {
  std::string s(text);
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || errno != 0 || !std::isfinite(value) || value < 0) return std::nullopt;
  std::string suffix;
  for (const char* c = end; *c; ++c) {
    if (!std::isspace(static_cast<unsigned char>(*c))) suffix += static_cast<char>(std::tolower(*c));
  }
  double scale = 1;
  if (!suffix.empty() && suffix.back() == 'b') suffix.pop_back();
  static const struct {
    const char* name;
    double scale;
  } kSuffixes[] = {
      {"", 1},           {"k", 1e3},           {"m", 1e6},
      {"g", 1e9},        {"t", 1e12},          {"ki", 1024.0},
      {"mi", 1048576.0}, {"gi", 1073741824.0}, {"ti", 1099511627776.0},
  };
  bool known = false;
  for (const auto& k : kSuffixes) {
    if (suffix == k.name) {
      scale = k.scale;
      known = true;
    }
  }
  if (!known) return std::nullopt;
  const double bytes = std::round(value * scale);
  if (bytes > 1.8e19) return std::nullopt;
  return static_cast<uint64_t>(bytes);
}

}  // namespace dcplan::schemas
