// Validation and serialisation of dcplan.network/v1 documents (see network.h).
#include <algorithm>

#include <nlohmann/json.hpp>

#include "calibration_json.h"
#include "dcplan/schemas/network.h"
#include "field_reader.h"
#include "read_document.h"

namespace dcplan::schemas {

using nlohmann::ordered_json;

std::vector<Diagnostic> validateNetwork(const ordered_json& doc, Network& out) {
  Diagnostics diags;
  FieldReader root(doc, "", diags);
  if (!root.isObject()) return diags.take();
  Network candidate;
  if (auto schema = root.string("schema"); schema && *schema != kNetworkSchema) {
    diags.add("/schema", "expected \"" + std::string(kNetworkSchema) + "\", got \"" + *schema + "\"");
  }
  candidate.createdBy = root.string("created_by").value_or("");
  readNetworkInto(root, diags, candidate);
  root.rejectUnknownFields();
  if (diags.empty()) out = std::move(candidate);
  return diags.take();
}

Network readNetwork(const std::filesystem::path& path) {
  return readDocument<Network>(path, DocumentKind::Network,
                               std::string("a network measurement (\"") + kNetworkSchema +
                                   "\", written by python -m dcplan.measure_network)",
                               validateNetwork);
}

std::string writeNetwork(const Network& network) {
  ordered_json doc{{"schema", kNetworkSchema}, {"created_by", network.createdBy}};
  doc.update(networkJson(network));
  return doc.dump(2) + "\n";
}

bool sameCollectives(const Network& a, const Network& b) {
  auto same = [](const std::vector<CalibrationPoint>& x, const std::vector<CalibrationPoint>& y) {
    return std::equal(x.begin(), x.end(), y.begin(), y.end(),
                      [](const CalibrationPoint& p, const CalibrationPoint& q) {
                        return p.bytes == q.bytes && p.us == q.us && p.deviceUs == q.deviceUs;
                      });
  };
  return a.worldSize == b.worldSize && a.backend == b.backend &&
         same(a.calibration.allGather, b.calibration.allGather) &&
         same(a.calibration.reduceScatter, b.calibration.reduceScatter) &&
         same(a.calibration.allReduce, b.calibration.allReduce);
}

}  // namespace dcplan::schemas
