// The calibration object's fields (see calibration_json.h).
#include "calibration_json.h"

#include <string>

namespace dcplan::schemas {

using nlohmann::ordered_json;
using P = FieldReader::Presence;

namespace {

std::vector<CalibrationPoint> readCurve(FieldReader& parent, const std::string& key, Diagnostics& diags) {
  std::vector<CalibrationPoint> curve;
  const ordered_json* list = parent.array(key);
  if (!list) return curve;
  const std::string ptr = parent.pointerOf(key);
  if (list->empty()) diags.add(ptr, "expected at least one calibration point");
  for (size_t i = 0; i < list->size(); ++i) {
    const std::string itemPtr = ptr + "/" + std::to_string(i);
    FieldReader r((*list)[i], itemPtr, diags);
    auto bytes = r.bytes("bytes");
    auto us = r.number("us", 0);
    auto deviceUs = r.number("device_us", 0, P::Optional);
    r.rejectUnknownFields();
    if (!bytes || !us) continue;
    if (!curve.empty() && *bytes <= curve.back().bytes) {
      diags.add(itemPtr + "/bytes", "calibration sizes must increase: " + std::to_string(*bytes) +
                                        " follows " + std::to_string(curve.back().bytes));
    }
    curve.push_back({*bytes, *us, deviceUs});
  }
  return curve;
}

ordered_json curveJson(const std::vector<CalibrationPoint>& curve) {
  ordered_json list = ordered_json::array();
  for (const auto& p : curve) {
    ordered_json point{{"bytes", p.bytes}, {"us", p.us}};
    if (p.deviceUs) point["device_us"] = *p.deviceUs;
    list.push_back(std::move(point));
  }
  return list;
}

}  // namespace

Calibration readCalibrationFields(FieldReader& r, Diagnostics& diags) {
  Calibration c;
  c.allGather = readCurve(r, "all_gather", diags);
  c.reduceScatter = readCurve(r, "reduce_scatter", diags);
  c.allReduce = readCurve(r, "all_reduce", diags);
  c.h2dGBps = r.positiveNumber("h2d_gbps", P::Optional);
  c.d2hGBps = r.positiveNumber("d2h_gbps", P::Optional);
  c.computeProbeUs = r.positiveNumber("compute_probe_us", P::Optional);
  return c;
}

ordered_json calibrationJson(const Calibration& c) {
  ordered_json out{{"all_gather", curveJson(c.allGather)},
                   {"reduce_scatter", curveJson(c.reduceScatter)},
                   {"all_reduce", curveJson(c.allReduce)}};
  if (c.h2dGBps) out["h2d_gbps"] = *c.h2dGBps;
  if (c.d2hGBps) out["d2h_gbps"] = *c.d2hGBps;
  if (c.computeProbeUs) out["compute_probe_us"] = *c.computeProbeUs;
  return out;
}

void readNetworkInto(FieldReader& r, Diagnostics& diags, Network& out) {
  out.worldSize = r.integer("world_size", 2).value_or(0);
  out.backend = r.oneOf("backend", {"gloo", "nccl"}).value_or("");
  out.device = r.string("device").value_or("");
  if (auto* calibration = r.object("calibration")) {
    FieldReader c(*calibration, r.pointerOf("calibration"), diags);
    out.calibration = readCalibrationFields(c, diags);
    c.rejectUnknownFields();
  }
}

ordered_json networkJson(const Network& n) {
  return {{"world_size", n.worldSize},
          {"backend", n.backend},
          {"device", n.device},
          {"calibration", calibrationJson(n.calibration)}};
}

}  // namespace dcplan::schemas
