// Byte-size and bandwidth parsing, and the number formats of reports.
#include "dcplan/planner/units.h"

#include "dcplan/schemas/units.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace dcplan::planner {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

/// Splits "1.5e9 GiB" into its leading number and the rest; strtod accepts the
/// same forms as the user would type (no hex, no inf, no nan: checked below).
bool splitNumber(std::string_view text, double& value, std::string_view& unit) {
  std::string buf(text);
  if (buf.empty() || !(std::isdigit(static_cast<unsigned char>(buf[0])) || buf[0] == '.' || buf[0] == '-' ||
                       buf[0] == '+')) {
    return false;
  }
  // Refuse the forms strtod takes but a size never is.
  std::string low = lower(buf);
  if (low.find("0x") != std::string::npos || low.find("inf") != std::string::npos ||
      low.find("nan") != std::string::npos) {
    return false;
  }
  char* end = nullptr;
  value = std::strtod(buf.c_str(), &end);
  if (end == buf.c_str()) return false;
  unit = trim(text.substr(static_cast<size_t>(end - buf.c_str())));
  return true;
}

}  // namespace

uint64_t parseByteSize(std::string_view raw) {
  // One grammar for sizes across dcplan: the schemas library owns it.
  if (auto bytes = schemas::parseByteSize(trim(raw))) return *bytes;
  throw std::invalid_argument("'" + std::string(raw) +
                              "' is not a size (expected e.g. 40GiB, 512MiB, 80GB or 1.5e9 bytes)");
}

double parseBandwidthGBps(std::string_view raw) {
  std::string_view text = trim(raw);
  double value = 0;
  std::string_view unit;
  if (!splitNumber(text, value, unit)) {
    throw std::invalid_argument("'" + std::string(raw) +
                                "' is not a bandwidth (expected GB/s, e.g. 200 or 25.5GB/s)");
  }
  std::string u = lower(unit);
  if (!(u.empty() || u == "gb/s" || u == "gbps")) {
    throw std::invalid_argument("unknown unit '" + std::string(unit) + "' in '" + std::string(raw) +
                                "' (bandwidth is in GB/s)");
  }
  if (!(value > 0) || !std::isfinite(value)) {
    throw std::invalid_argument("bandwidth '" + std::string(raw) + "' must be positive");
  }
  return value;
}

std::string formatFixed(double value, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, value);
  std::string s(buf);
  // "-0.00" reads like a regression in a diff; it is zero.
  bool allZero = true;
  for (char c : s) {
    if (c != '-' && c != '0' && c != '.') allZero = false;
  }
  if (allZero && !s.empty() && s[0] == '-') s.erase(0, 1);
  return s;
}

std::string formatChange(double before, double now) {
  if (before == 0) return now == 0 ? "+0.0%" : "n/a";
  double pct = (now - before) / before * 100.0;
  std::string s = formatFixed(pct, 1);
  if (s[0] != '-') s = "+" + s;
  return s + "%";
}

}  // namespace dcplan::planner
