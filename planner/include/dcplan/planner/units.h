// Parsing and printing of the quantities the planner's options and reports use.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace dcplan::planner {

/// Parses a byte size as schemas::parseByteSize does ("40GiB", "512 MiB", "1.5e9",
/// "80GB"); throws std::invalid_argument with a one-line message instead of
/// returning nullopt.
uint64_t parseByteSize(std::string_view text);

/// Parses a bandwidth in GB/s: a positive number with an optional "GB/s" or
/// "GBps" suffix. Throws std::invalid_argument with a one-line message.
double parseBandwidthGBps(std::string_view text);

/// Fixed-point with `decimals` digits; never prints "-0.0".
std::string formatFixed(double value, int decimals);

/// Signed relative change of `now` against `before`, e.g. "-17.7%"; "n/a" when
/// `before` is zero.
std::string formatChange(double before, double now);

}  // namespace dcplan::planner
