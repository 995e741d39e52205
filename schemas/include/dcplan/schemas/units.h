// Human-readable sizes and times, and parsing of sizes such as "40GiB".
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace dcplan::schemas {

/// "0 B", "512 B", "1.50 KiB", "247.0 MiB", "1.25 GiB" (IEC units, 3 significant digits).
std::string formatBytes(uint64_t bytes);

/// Microseconds as milliseconds with 3 decimals: "12.345 ms".
std::string formatMs(double us);

/// Parses "40GiB", "512 MiB", "1.5GB", "1e9", "800000": IEC (KiB..TiB) and SI (KB..TB)
/// suffixes, case-insensitive, an optional "B". nullopt when it is not a size.
std::optional<uint64_t> parseByteSize(std::string_view text);

}  // namespace dcplan::schemas
