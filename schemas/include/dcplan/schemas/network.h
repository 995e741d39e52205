// A measurement of a cluster's collectives without a model (`python -m dcplan.measure_network`),
// for planning at a world size the trace was not recorded at (`dcplan plan --network`).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "dcplan/schemas/io.h"
#include "dcplan/schemas/trace.h"

namespace dcplan::schemas {

inline constexpr const char* kNetworkSchema = "dcplan.network/v1";

/// Checks a dcplan.network/v1 document; fills `out` when there is no problem.
std::vector<Diagnostic> validateNetwork(const nlohmann::ordered_json& doc, Network& out);
/// Read + validate; throws InputError naming the file and every problem.
Network readNetwork(const std::filesystem::path& path);
/// Deterministic serialisation (2-space indent, newline at end).
std::string writeNetwork(const Network& network);

/// Whether two measurements time the same collectives alike: world size, backend and every curve's
/// points (who wrote them, the device's name and the host-link rates aside).
bool sameCollectives(const Network& a, const Network& b);

}  // namespace dcplan::schemas
