// FNV-1a 64-bit: a small, stable hash for identifying parameter tables and traces.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace dcplan::schemas {

inline std::string fnv1a64(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  char out[32];
  std::snprintf(out, sizeof out, "fnv1a64:%016llx", static_cast<unsigned long long>(h));
  return out;
}

}  // namespace dcplan::schemas
