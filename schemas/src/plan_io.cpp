// Validation and serialisation of dcplan.plan/v1 documents.
#include <algorithm>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "calibration_json.h"
#include "dcplan/schemas/io.h"
#include "field_reader.h"
#include "read_document.h"

namespace dcplan::schemas {

using nlohmann::ordered_json;
using P = FieldReader::Presence;

namespace {

class PlanValidator {
 public:
  explicit PlanValidator(Plan& out) : out_(out) {}

  std::vector<Diagnostic> run(const ordered_json& doc) {
    FieldReader root(doc, "", diags_);
    if (!root.isObject()) return diags_.take();
    if (auto schema = root.string("schema"); schema && *schema != kPlanSchema) {
      diags_.add("/schema", "expected \"" + std::string(kPlanSchema) + "\", got \"" + *schema + "\"");
    }
    out_.createdBy = root.string("created_by").value_or("");
    if (auto* source = root.object("source")) readSource(*source);
    if (auto* options = root.object("options")) readOptions(*options);
    if (auto persistent = root.integers("persistent", 0)) {
      for (size_t i = 1; i < persistent->size(); ++i) {
        if ((*persistent)[i] <= (*persistent)[i - 1]) {
          diags_.add("/persistent/" + std::to_string(i),
                     "ids must be unique and ascending: " + std::to_string((*persistent)[i]) + " follows " +
                         std::to_string((*persistent)[i - 1]));
        }
      }
      out_.persistent = *persistent;
    }
    if (auto* guard = root.object("guard", P::Optional)) readGuard(*guard);
    if (auto* graphs = root.array("graphs")) readGraphs(*graphs);
    if (auto* offload = root.object("offload", P::Optional)) readOffload(*offload);
    if (auto* predicted = root.object("predicted")) out_.predicted = readPrediction(*predicted, "/predicted");
    if (auto* predicted = root.object("predicted_default")) {
      out_.predictedDefault = readPrediction(*predicted, "/predicted_default");
    }
    root.rejectUnknownFields();
    return diags_.take();
  }

 private:
  // Checked by hand, not with std::regex: std::regex's template instances are shared with
  // libtorch_python's in one process, and are only as safe as the two compilers agree
  // (docs/gpu.md: a newer compiler than the loaded libstdc++ crashed there).
  static bool isFnvDigest(const std::string& s) {
    const std::string prefix = "fnv1a64:";
    if (s.size() != prefix.size() + 16 || s.compare(0, prefix.size(), prefix) != 0) return false;
    return std::all_of(s.begin() + prefix.size(), s.end(),
                       [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
  }

  void readHash(FieldReader& r, const std::string& key, std::string& out) {
    auto s = r.string(key);
    if (!s) return;
    if (!isFnvDigest(*s)) {
      diags_.add(r.pointerOf(key), "expected \"fnv1a64:\" and 16 hex digits, got \"" + *s + "\"");
    }
    out = *s;
  }

  void readSource(const ordered_json& value) {
    FieldReader r(value, "/source", diags_);
    PlanSource& s = out_.source;
    s.trace = r.string("trace").value_or("");
    readHash(r, "trace_digest", s.traceDigest);
    readHash(r, "param_signature", s.paramSignature);
    s.worldSize = r.integer("world_size", 1).value_or(1);
    if (auto stage = r.integer("stage", 1)) {
      if (*stage > 3) diags_.add(r.pointerOf("stage"), "expected 1, 2 or 3, got " + std::to_string(*stage));
      s.stage = *stage;
    }
    s.replay = r.oneOf("replay", {"eager", "compiled"}, P::Optional).value_or("eager");
    r.rejectUnknownFields();
  }

  void readOptions(const ordered_json& value) {
    FieldReader r(value, "/options", diags_);
    PlanOptions& o = out_.options;
    o.strategy = r.oneOf("strategy", {"default", "heuristic", "optimized"}).value_or("");
    o.memoryBudgetBytes = r.bytes("memory_budget_bytes", P::Optional);
    o.bandwidthGBps = r.positiveNumber("bandwidth_gbps", P::Optional);
    o.gradAccumSteps = r.integer("grad_accum_steps", 1).value_or(1);
    o.cudaGraph = r.boolean("cuda_graph", P::Optional).value_or(false);
    o.deviceTimes = r.boolean("device_times", P::Optional).value_or(false);
    if (o.deviceTimes && o.cudaGraph) {
      diags_.add(r.pointerOf("device_times"),
                 "a plan for a CUDA graph (cuda_graph) always runs on the device's own times: expected no "
                 "device_times");
    }
    o.inSituScale = r.positiveNumber("in_situ_scale", P::Optional);
    o.hostScale = r.positiveNumber("host_scale", P::Optional);
    if (o.hostScale && o.cudaGraph) {
      diags_.add(r.pointerOf("host_scale"),
                 "a plan for a CUDA graph (cuda_graph) is made from the device's own times, with no host "
                 "time to scale: expected no host_scale");
    }
    o.deviceScale = r.positiveNumber("device_scale", P::Optional);
    if (o.deviceScale && !o.cudaGraph) {
      diags_.add(r.pointerOf("device_scale"),
                 "a plan for the host's replay is calibrated by its host's pace or its collectives "
                 "(host_scale, in_situ_scale): expected device_scale only beside cuda_graph");
    }
    if (auto* network = r.object("network", P::Optional)) {
      FieldReader n(*network, r.pointerOf("network"), diags_);
      PlanNetwork& planned = o.network.emplace();
      planned.file = n.string("file").value_or("");
      readNetworkInto(n, diags_, planned.measured);
      n.rejectUnknownFields();
    }
    r.rejectUnknownFields();
  }

  std::vector<int64_t> readIds(FieldReader& r, const std::string& key) {
    auto ids = r.integers("ds_ids", 0);
    if (!ids) return {};
    if (ids->empty()) diags_.add(r.pointerOf(key), "expected at least one id");
    std::set<int64_t> seen;
    for (size_t i = 0; i < ids->size(); ++i) {
      if (!seen.insert((*ids)[i]).second) {
        diags_.add(r.pointerOf(key) + "/" + std::to_string(i), "duplicate id " + std::to_string((*ids)[i]));
      }
    }
    return *ids;
  }

  void readGraphs(const ordered_json& list) {
    std::set<int64_t> graphIds;
    for (size_t g = 0; g < list.size(); ++g) {
      const std::string ptr = "/graphs/" + std::to_string(g);
      FieldReader r(list[g], ptr, diags_);
      PlanGraph graph;
      if (auto id = r.integer("id", 0)) {
        if (!graphIds.insert(*id).second)
          diags_.add(ptr + "/id", "duplicate graph id " + std::to_string(*id));
        graph.id = *id;
      }
      if (auto kind = r.oneOf("kind", {"forward", "backward"})) {
        graph.kind = *kind == "forward" ? GraphKind::Forward : GraphKind::Backward;
      }
      graph.inputShapes = r.inputShapes(graph.kind);
      if (auto* prefetch = r.array("prefetch")) {
        std::optional<int64_t> lastPosition;
        for (size_t i = 0; i < prefetch->size(); ++i) {
          const std::string itemPtr = ptr + "/prefetch/" + std::to_string(i);
          FieldReader item((*prefetch)[i], itemPtr, diags_);
          PrefetchGroup group;
          if (auto position = item.integer("position", 0)) {
            if (lastPosition && *position < *lastPosition) {
              diags_.add(itemPtr + "/position", "positions must not decrease: " + std::to_string(*position) +
                                                    " follows " + std::to_string(*lastPosition));
            }
            lastPosition = position;
            group.position = *position;
          }
          group.dsIds = readIds(item, "ds_ids");
          group.peakBytes = item.bytes("peak_bytes", P::Optional);
          item.rejectUnknownFields();
          graph.prefetch.push_back(std::move(group));
        }
      }
      if (auto* buckets = r.array("buckets")) {
        std::map<int64_t, size_t> bucketOf;
        for (size_t i = 0; i < buckets->size(); ++i) {
          const std::string itemPtr = ptr + "/buckets/" + std::to_string(i);
          FieldReader item((*buckets)[i], itemPtr, diags_);
          PlanBucket bucket;
          bucket.dsIds = readIds(item, "ds_ids");
          claimIds(bucket.dsIds, itemPtr, i, bucketOf, "bucket");
          bucket.bytes = item.bytes("bytes").value_or(0);
          bucket.dtype = item.dtype("dtype").value_or("");
          item.rejectUnknownFields();
          graph.buckets.push_back(std::move(bucket));
        }
      }
      if (auto* saves = r.array("offload_saves", P::Optional))
        readOffloadSaves(*saves, r.pointerOf("offload_saves"), graph);
      if (auto* ends = r.array("persistent_ends", P::Optional))
        readPersistentEnds(*ends, r.pointerOf("persistent_ends"), graph);
      r.rejectUnknownFields();
      out_.graphs.push_back(std::move(graph));
    }
  }

  /// An item's integer `field` (>= 0; 0 where missing) of a list whose `noun` must increase: one
  /// not above `last` (the previous item's) is named.
  int64_t increasing(FieldReader& item, const char* field, const char* noun, std::optional<int64_t>& last) {
    const std::optional<int64_t> value = item.integer(field, 0);
    if (!value) return 0;
    if (last && *value <= *last) {
      diags_.add(item.pointerOf(field), std::string("expected the ") + noun + " in increasing order, got " +
                                            std::to_string(*value) + " after " + std::to_string(*last));
    }
    last = value;
    return *value;
  }

  /// A graph's list (at ptr) that only graphs of kind `owner` have: each item read by
  /// readItem, its unknown fields refused; in a graph of the other kind, the whole list refused.
  template <typename ReadItem>
  void readGraphList(const ordered_json& list, const std::string& ptr, const PlanGraph& graph,
                     GraphKind owner, const char* refusal, ReadItem&& readItem) {
    if (graph.kind != owner) {
      diags_.add(ptr, refusal);
      return;
    }
    for (size_t i = 0; i < list.size(); ++i) {
      FieldReader item(list[i], ptr + "/" + std::to_string(i), diags_);
      readItem(item);
      item.rejectUnknownFields();
    }
  }

  /// A forward graph's offload_saves: first saves in increasing order, each with its bytes.
  void readOffloadSaves(const ordered_json& list, const std::string& ptr, PlanGraph& graph) {
    std::optional<int64_t> last;
    const char* refusal = "offloaded saves belong to forward graphs; this graph is a backward";
    readGraphList(list, ptr, graph, GraphKind::Forward, refusal, [&](FieldReader& item) {
      OffloadedSave save;
      save.pack = increasing(item, "pack", "saves", last);
      save.bytes = item.bytes("bytes").value_or(0);
      if (save.bytes == 0 && item.isObject())
        diags_.add(item.pointerOf("bytes"), "expected the storage's size, > 0");
      graph.offloadSaves.push_back(save);
    });
  }

  /// A backward graph's persistent_ends: positions in increasing order, each a persistent parameter's.
  void readPersistentEnds(const ordered_json& list, const std::string& ptr, PlanGraph& graph) {
    std::optional<int64_t> last;
    const char* refusal = "persistent copies end in backward graphs; this graph is a forward";
    readGraphList(list, ptr, graph, GraphKind::Backward, refusal, [&](FieldReader& item) {
      PersistentEnd end;
      end.position = increasing(item, "position", "positions", last);
      const std::optional<int64_t> id = item.integer("ds_id", 0);
      end.dsId = id.value_or(0);
      // Only a persistent copy has an end to name (/persistent is read before the graphs).
      if (id && !std::binary_search(out_.persistent.begin(), out_.persistent.end(), *id)) {
        diags_.add(item.pointerOf("ds_id"),
                   "expected a ds_id of /persistent (a persistent parameter), got " +
                       std::to_string(end.dsId));
      }
      graph.persistentEnds.push_back(end);
    });
  }

  /// Each id in one item of a list at most (a bucket, an offload group): a repeat is named.
  void claimIds(const std::vector<int64_t>& ids, const std::string& itemPtr, size_t item,
                std::map<int64_t, size_t>& owner, const char* noun) {
    for (size_t k = 0; k < ids.size(); ++k) {
      auto [it, fresh] = owner.emplace(ids[k], item);
      if (!fresh && it->second != item) {
        diags_.add(
            itemPtr + "/ds_ids/" + std::to_string(k),
            "id " + std::to_string(ids[k]) + " is already in " + noun + " " + std::to_string(it->second));
      }
    }
  }

  void readGuard(const ordered_json& value) {
    FieldReader r(value, "/guard", diags_);
    Plan::Guard guard;
    guard.startBytes = r.bytes("start_bytes").value_or(0);
    if (auto peaks = r.integers("persistent_peak_bytes", 0)) {
      if (peaks->size() != out_.persistent.size()) {
        diags_.add("/guard/persistent_peak_bytes", "expected one entry per id of /persistent (" +
                                                       std::to_string(out_.persistent.size()) + "), got " +
                                                       std::to_string(peaks->size()));
      }
      guard.persistentPeakBytes.assign(peaks->begin(), peaks->end());
    }
    r.rejectUnknownFields();
    out_.guard = std::move(guard);
  }

  void readOffload(const ordered_json& value) {
    FieldReader r(value, "/offload", diags_);
    auto* groups = r.array("optimizer_state");
    if (groups && groups->empty()) diags_.add("/offload/optimizer_state", "expected at least one group");
    std::map<int64_t, size_t> groupOf;
    for (size_t i = 0; groups && i < groups->size(); ++i) {
      const std::string itemPtr = "/offload/optimizer_state/" + std::to_string(i);
      FieldReader item((*groups)[i], itemPtr, diags_);
      OffloadGroup group;
      group.dsIds = readIds(item, "ds_ids");
      claimIds(group.dsIds, itemPtr, i, groupOf, "group");
      group.bytes = item.bytes("bytes").value_or(0);
      if (auto master = item.bytes("master_bytes", P::Optional)) {
        if (*master == 0)
          diags_.add(itemPtr + "/master_bytes", "expected an integer >= 1 (absent: kept on the device)");
        group.masterBytes = *master;
      }
      item.rejectUnknownFields();
      out_.optimizerOffload.push_back(std::move(group));
    }
    r.rejectUnknownFields();
  }

  Prediction readPrediction(const ordered_json& value, const std::string& ptr) {
    FieldReader r(value, ptr, diags_);
    Prediction p;
    p.stepUs = r.number("step_us", 0).value_or(0);
    p.exposedCommUs = r.number("exposed_comm_us", 0).value_or(0);
    p.peakMemoryBytes = r.bytes("peak_memory_bytes").value_or(0);
    p.offloadBytes = r.bytes("offload_bytes", P::Optional).value_or(0);
    p.reloadUs = r.number("reload_us", 0, P::Optional).value_or(0);
    p.offloadUs = r.number("offload_us", 0, P::Optional).value_or(0);
    p.exposedCopyUs = r.number("exposed_copy_us", 0, P::Optional).value_or(0);
    p.activationOffloadBytes = r.bytes("activation_offload_bytes", P::Optional).value_or(0);
    p.activationCopyUs = r.number("activation_copy_us", 0, P::Optional).value_or(0);
    p.copyInUs = r.number("copy_in_us", 0, P::Optional).value_or(0);
    p.copyOutUs = r.number("copy_out_us", 0, P::Optional).value_or(0);
    p.unconstrainedStepUs = r.number("unconstrained_step_us", 0, P::Optional).value_or(0);
    p.copyBoundUs = r.number("copy_bound_us", 0, P::Optional).value_or(0);
    r.rejectUnknownFields();
    return p;
  }

  Plan& out_;
  Diagnostics diags_;
};

ordered_json predictionJson(const Prediction& p) {
  ordered_json out{
      {"step_us", p.stepUs}, {"exposed_comm_us", p.exposedCommUs}, {"peak_memory_bytes", p.peakMemoryBytes}};
  if (p.offloadBytes > 0) {
    out["offload_bytes"] = p.offloadBytes;
    out["reload_us"] = p.reloadUs;
    out["offload_us"] = p.offloadUs;
    out["exposed_copy_us"] = p.exposedCopyUs;
  }
  if (p.activationOffloadBytes > 0) {
    out["activation_offload_bytes"] = p.activationOffloadBytes;
    out["activation_copy_us"] = p.activationCopyUs;
  }
  if (p.copyBoundUs > 0) {
    out["copy_in_us"] = p.copyInUs;
    out["copy_out_us"] = p.copyOutUs;
    out["unconstrained_step_us"] = p.unconstrainedStepUs;
    out["copy_bound_us"] = p.copyBoundUs;
  }
  return out;
}

}  // namespace

std::vector<Diagnostic> validatePlan(const ordered_json& doc, Plan& out) {
  Plan candidate;
  auto diags = PlanValidator(candidate).run(doc);
  if (diags.empty()) out = std::move(candidate);
  return diags;
}

Plan readPlan(const std::filesystem::path& path) {
  return readDocument<Plan>(path, DocumentKind::Plan, std::string("a plan (\"") + kPlanSchema + "\")",
                            validatePlan);
}

std::string writePlan(const Plan& plan) {
  ordered_json options{{"strategy", plan.options.strategy}};
  if (plan.options.memoryBudgetBytes) options["memory_budget_bytes"] = *plan.options.memoryBudgetBytes;
  if (plan.options.bandwidthGBps) options["bandwidth_gbps"] = *plan.options.bandwidthGBps;
  options["grad_accum_steps"] = plan.options.gradAccumSteps;
  if (plan.options.cudaGraph) options["cuda_graph"] = true;
  if (plan.options.deviceTimes) options["device_times"] = true;
  if (plan.options.inSituScale) options["in_situ_scale"] = *plan.options.inSituScale;
  if (plan.options.hostScale) options["host_scale"] = *plan.options.hostScale;
  if (plan.options.deviceScale) options["device_scale"] = *plan.options.deviceScale;
  if (plan.options.network) {
    options["network"] = {{"file", plan.options.network->file}};
    options["network"].update(networkJson(plan.options.network->measured));
  }

  ordered_json graphs = ordered_json::array();
  for (const auto& g : plan.graphs) {
    ordered_json prefetch = ordered_json::array();
    for (const auto& p : g.prefetch) {
      ordered_json group{{"position", p.position}, {"ds_ids", p.dsIds}};
      if (p.peakBytes) group["peak_bytes"] = *p.peakBytes;
      prefetch.push_back(std::move(group));
    }
    ordered_json buckets = ordered_json::array();
    for (const auto& b : g.buckets)
      buckets.push_back({{"ds_ids", b.dsIds}, {"bytes", b.bytes}, {"dtype", b.dtype}});
    ordered_json graph{{"id", g.id}, {"kind", graphKindName(g.kind)}};
    if (g.inputShapes) graph["input_shapes"] = *g.inputShapes;
    graph["prefetch"] = std::move(prefetch);
    graph["buckets"] = std::move(buckets);
    if (!g.offloadSaves.empty()) {
      ordered_json saves = ordered_json::array();
      for (const OffloadedSave& o : g.offloadSaves) saves.push_back({{"pack", o.pack}, {"bytes", o.bytes}});
      graph["offload_saves"] = std::move(saves);
    }
    if (!g.persistentEnds.empty()) {
      ordered_json ends = ordered_json::array();
      for (const PersistentEnd& e : g.persistentEnds) ends.push_back({{"position", e.position}, {"ds_id", e.dsId}});
      graph["persistent_ends"] = std::move(ends);
    }
    graphs.push_back(std::move(graph));
  }
  ordered_json source{{"trace", plan.source.trace},
                      {"trace_digest", plan.source.traceDigest},
                      {"param_signature", plan.source.paramSignature},
                      {"world_size", plan.source.worldSize},
                      {"stage", plan.source.stage}};
  if (plan.source.replay != "eager") source["replay"] = plan.source.replay;  // absent: eager
  ordered_json doc{
      {"schema", kPlanSchema},         {"created_by", plan.createdBy},  {"source", std::move(source)},
      {"options", std::move(options)}, {"persistent", plan.persistent},
  };
  doc["graphs"] = std::move(graphs);
  if (plan.guard) {
    doc["guard"] = {{"start_bytes", plan.guard->startBytes},
                    {"persistent_peak_bytes", plan.guard->persistentPeakBytes}};
  }
  if (!plan.optimizerOffload.empty()) {
    ordered_json groups = ordered_json::array();
    for (const auto& g : plan.optimizerOffload) {
      ordered_json group{{"ds_ids", g.dsIds}, {"bytes", g.bytes}};
      if (g.masterBytes > 0) group["master_bytes"] = g.masterBytes;  // absent: on the device
      groups.push_back(std::move(group));
    }
    doc["offload"] = {{"optimizer_state", std::move(groups)}};
  }
  doc.update(ordered_json{
      {"predicted", predictionJson(plan.predicted)},
      {"predicted_default", predictionJson(plan.predictedDefault)},
  });
  return doc.dump(2) + "\n";
}

}  // namespace dcplan::schemas
