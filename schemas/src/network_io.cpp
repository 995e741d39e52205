// Validation and serialisation of dcplan.network/v1 documents (see network.h).
#include <nlohmann/json.hpp>

#include "calibration_json.h"
#include "dcplan/schemas/network.h"
#include "field_reader.h"

namespace dcplan::schemas {

using nlohmann::ordered_json;

namespace {

/// The meta fields of a network file, which a plan made with --network repeats beside the curves.
void readNetworkFields(FieldReader& r, Network& out) {
  out.worldSize = r.integer("world_size", 2).value_or(0);
  out.backend = r.oneOf("backend", {"gloo", "nccl"}).value_or("");
  out.device = r.string("device").value_or("");
}

}  // namespace

void readNetworkInto(FieldReader& r, Diagnostics& diags, Network& out) {
  readNetworkFields(r, out);
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
  const std::string name = path.string();
  ordered_json doc = readJsonFile(path);
  if (detectKind(doc, name) != DocumentKind::Network) {
    throw InputError(name, {{"/schema", std::string("expected a network measurement (\"") + kNetworkSchema +
                                            "\", written by python -m dcplan.measure_network), got \"" +
                                            doc["schema"].get<std::string>() + "\""}});
  }
  Network network;
  auto diags = validateNetwork(doc, network);
  if (!diags.empty()) throw InputError(name, std::move(diags));
  return network;
}

std::string writeNetwork(const Network& network) {
  ordered_json doc{{"schema", kNetworkSchema}, {"created_by", network.createdBy}};
  doc.update(networkJson(network));
  return doc.dump(2) + "\n";
}

}  // namespace dcplan::schemas
