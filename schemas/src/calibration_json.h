// The calibration object's fields (collective curves, host-link rates) and a network's, shared by
// traces, network files and plans made with --network.
#pragma once

#include <nlohmann/json.hpp>

#include "dcplan/schemas/network.h"
#include "dcplan/schemas/trace.h"
#include "field_reader.h"

namespace dcplan::schemas {

/// Reads "all_gather", "reduce_scatter", "all_reduce" (required) and "h2d_gbps", "d2h_gbps"
/// (optional) of the object `r` reads; the caller rejects unknown fields.
Calibration readCalibrationFields(FieldReader& r, Diagnostics& diags);

/// The calibration as its JSON object.
nlohmann::ordered_json calibrationJson(const Calibration& calibration);

/// A network's "world_size", "backend", "device" and "calibration" fields, read from the object
/// `r` reads (a network file's top level, a plan's options.network); the caller rejects unknown
/// fields.
void readNetworkInto(FieldReader& r, Diagnostics& diags, Network& out);
/// Those fields as a JSON object.
nlohmann::ordered_json networkJson(const Network& network);

}  // namespace dcplan::schemas
