// Validation and serialisation of dcplan.trace/v1 documents.
#include <algorithm>
#include <map>
#include <numeric>
#include <set>

#include <nlohmann/json.hpp>

#include "calibration_json.h"
#include "dcplan/schemas/dtype.h"
#include "dcplan/schemas/io.h"
#include "field_reader.h"
#include "hash.h"
#include "read_document.h"

namespace dcplan::schemas {

using nlohmann::ordered_json;
using P = FieldReader::Presence;

const char* graphKindName(GraphKind kind) { return kind == GraphKind::Forward ? "forward" : "backward"; }

namespace {

// How many parameter ids each op names in its "ds_id" / "ds_ids" field.
enum class IdArity { None, One, Many, TensorId };

struct OpInfo {
  IdArity ids;
  OpRole role;
};

/// Every dc op of the trace format: the one place that says what an op is.
const std::map<std::string, OpInfo>& traceOps() {
  static const std::map<std::string, OpInfo> ops{
      {"allgather_param", {IdArity::One, OpRole::Gather}},
      {"prefetch_params_fused", {IdArity::Many, OpRole::Prefetch}},
      {"wait_allgather", {IdArity::One, OpRole::GatherWait}},
      {"release_param", {IdArity::One, OpRole::Release}},
      {"reduce_grad", {IdArity::One, OpRole::ReduceGrad}},
      {"free_tensors", {IdArity::None, OpRole::Free}},
      {"offload_tensor", {IdArity::TensorId, OpRole::Offload}},
      {"reload_tensor", {IdArity::TensorId, OpRole::Reload}},
      {"wait_offload", {IdArity::TensorId, OpRole::CopyWait}},
      {"wait_reload", {IdArity::TensorId, OpRole::CopyWait}},
      {"offload_parameter", {IdArity::One, OpRole::Offload}},
      {"reload_parameter", {IdArity::One, OpRole::Reload}},
      {"end_backward", {IdArity::None, OpRole::EndBackward}},
  };
  return ops;
}

const OpInfo* findOp(const std::string& op) {
  auto it = traceOps().find(op);
  return it == traceOps().end() ? nullptr : &it->second;
}

}  // namespace

std::optional<OpRole> opRole(const std::string& op) {
  if (const OpInfo* info = findOp(op)) return info->role;
  return std::nullopt;
}

bool waitsForAnotherStream(const std::string& op) {
  const auto role = opRole(op);
  return role == OpRole::GatherWait || role == OpRole::CopyWait || role == OpRole::EndBackward;
}

namespace {

std::string opNames() {
  std::string out;
  for (const auto& [name, info] : traceOps()) out += (out.empty() ? "" : ", ") + name;
  return out;
}

class TraceValidator {
 public:
  explicit TraceValidator(Trace& out) : out_(out) {}

  std::vector<Diagnostic> run(const ordered_json& doc) {
    FieldReader root(doc, "", diags_);
    if (!root.isObject()) return diags_.take();
    if (auto schema = root.string("schema"); schema && *schema != kTraceSchema) {
      diags_.add("/schema", "expected \"" + std::string(kTraceSchema) + "\", got \"" + *schema + "\"");
    }
    if (auto* meta = root.object("meta")) readMeta(*meta);
    if (auto* memory = root.object("memory")) readMemory(*memory);
    if (auto* params = root.array("params")) readParams(*params);
    if (auto* calibration = root.object("calibration")) readCalibration(*calibration);
    if (auto* steps = root.array("steps")) readSteps(*steps);
    root.rejectUnknownFields();
    return diags_.take();
  }

 private:
  void readMeta(const ordered_json& value) {
    FieldReader r(value, "/meta", diags_);
    TraceMeta& meta = out_.meta;
    meta.createdBy = r.string("created_by").value_or("");
    worldSize_ = r.integer("world_size", 1);
    meta.worldSize = worldSize_.value_or(1);
    meta.backend = r.oneOf("backend", {"nccl", "gloo"}).value_or("");
    meta.device = r.string("device").value_or("");
    if (auto stage = r.integer("stage", 1)) {
      if (*stage > 3) diags_.add(r.pointerOf("stage"), "expected 1, 2 or 3, got " + std::to_string(*stage));
      meta.stage = *stage;
    }
    meta.gradAccumSteps = r.integer("grad_accum_steps", 1).value_or(1);
    meta.paramDtype = r.dtype("param_dtype").value_or("");
    meta.reduceDtype = r.dtype("reduce_dtype").value_or("");
    meta.replay = r.oneOf("replay", {"eager", "compiled"}, FieldReader::Optional).value_or("eager");
    meta.graphed = r.boolean("graphed", FieldReader::Optional).value_or(false);
    meta.checksCollectives = r.boolean("checks_collectives", FieldReader::Optional).value_or(false);
    if (auto* versions = r.object("versions")) {
      for (const auto& [key, v] : versions->items()) {
        if (!v.is_string()) {
          diags_.add(r.pointerOf("versions") + "/" + escapePointerToken(key),
                     "expected a version string, got " + describeValue(v));
        } else {
          meta.versions[key] = v.get<std::string>();
        }
      }
    }
    r.rejectUnknownFields();
  }

  void readMemory(const ordered_json& value) {
    FieldReader r(value, "/memory", diags_);
    out_.memory.capacityBytes = r.bytes("capacity_bytes").value_or(0);
    out_.memory.baselineBytes = r.bytes("baseline_bytes").value_or(0);
    r.rejectUnknownFields();
  }

  void readParams(const ordered_json& list) {
    const size_t diagsBefore = diags_.size();
    std::map<int64_t, size_t> firstById;
    std::map<std::string, size_t> firstByName;
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string ptr = "/params/" + std::to_string(i);
      FieldReader r(list[i], ptr, diags_);
      TraceParam p;
      auto id = r.integer("id", 0);
      auto name = r.string("name");
      auto shape = r.integers("shape", 0);
      auto dtype = r.dtype("dtype");
      auto numel = r.integer("numel", 0);
      auto shardNumel = r.integer("shard_numel", 0);
      auto requiresGrad = r.boolean("requires_grad");
      p.optimizerStateBytes = r.bytes("optimizer_state_bytes", P::Optional);
      p.optimizerImpl = r.oneOf("optimizer_impl", optimizerImpls(), P::Optional);
      p.optimizerGroup = r.integer("optimizer_group", 0, P::Optional);
      r.rejectUnknownFields();
      if (id) {
        auto [it, fresh] = firstById.emplace(*id, i);
        if (!fresh) {
          diags_.add(ptr + "/id", "duplicate parameter id " + std::to_string(*id) + " (first at /params/" +
                                      std::to_string(it->second) + ")");
        }
        p.id = *id;
      }
      if (name) {
        if (name->empty()) diags_.add(ptr + "/name", "expected a non-empty name");
        auto [it, fresh] = firstByName.emplace(*name, i);
        if (!fresh && !name->empty()) {
          diags_.add(ptr + "/name", "duplicate parameter name \"" + *name + "\" (first at /params/" +
                                        std::to_string(it->second) + ")");
        }
        p.name = *name;
      }
      bool numelConsistent = numel.has_value();
      if (shape && numel) {
        const int64_t product = std::accumulate(shape->begin(), shape->end(), int64_t{1},
                                                [](int64_t a, int64_t b) { return a * b; });
        if (product != *numel) {
          diags_.add(ptr + "/numel", "expected " + std::to_string(product) + " (the product of shape), got " +
                                         std::to_string(*numel));
          numelConsistent = false;
        }
      }
      if (numelConsistent && shardNumel && worldSize_) {
        const int64_t expected = (*numel + *worldSize_ - 1) / *worldSize_;
        if (*shardNumel != expected) {
          diags_.add(ptr + "/shard_numel", "expected " + std::to_string(expected) +
                                               " (ceil(numel / world_size)), got " +
                                               std::to_string(*shardNumel));
        }
      }
      p.shape = shape.value_or(std::vector<int64_t>{});
      p.dtype = dtype.value_or("");
      p.numel = numel.value_or(0);
      p.shardNumel = shardNumel.value_or(0);
      p.requiresGrad = requiresGrad.value_or(true);
      out_.params.push_back(std::move(p));
    }
    for (const auto& [id, index] : firstById) paramIds_.insert(id);
    // Ids that dangle from a broken table would only repeat its problem.
    paramTableValid_ = diags_.size() == diagsBefore;
  }

  void readCalibration(const ordered_json& value) {
    FieldReader r(value, "/calibration", diags_);
    out_.calibration = readCalibrationFields(r, diags_);
    out_.calibration.graphStepUs = r.positiveNumber("graph_step_us", P::Optional);  // a trace's own
    if (out_.calibration.graphStepUs && !out_.meta.graphed) {  // meta is read first
      diags_.add("/calibration/graph_step_us",
                 "a captured step's time is a dcplan.graphed_step recording's: expected it only beside "
                 "meta.graphed");
    }
    r.rejectUnknownFields();
  }

  void readSteps(const ordered_json& list) {
    if (list.empty()) diags_.add("/steps", "expected at least one recorded step");
    std::optional<int64_t> lastIndex;
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string ptr = "/steps/" + std::to_string(i);
      FieldReader r(list[i], ptr, diags_);
      TraceStep step;
      if (auto index = r.integer("index", 0)) {
        if (lastIndex && *index <= *lastIndex) {
          diags_.add(ptr + "/index", "step indices must increase: " + std::to_string(*index) + " follows " +
                                         std::to_string(*lastIndex));
        }
        lastIndex = index;
        step.index = *index;
      }
      step.optimizerUs = r.number("optimizer_us", 0).value_or(0);
      step.optimizerHostUs = r.number("optimizer_host_us", 0, P::Optional);
      step.optimizerDeviceUs = r.number("optimizer_device_us", 0, P::Optional);
      if (auto* graphs = r.array("graphs")) {
        if (graphs->empty()) diags_.add(ptr + "/graphs", "expected at least one graph");
        std::set<int64_t> ids;
        for (size_t g = 0; g < graphs->size(); ++g) {
          TraceGraph graph = readGraph((*graphs)[g], ptr + "/graphs/" + std::to_string(g));
          if (!ids.insert(graph.id).second) {
            diags_.add(ptr + "/graphs/" + std::to_string(g) + "/id",
                       "duplicate graph id " + std::to_string(graph.id) + " in this step");
          }
          step.graphs.push_back(std::move(graph));
        }
      }
      r.rejectUnknownFields();
      out_.steps.push_back(std::move(step));
    }
  }

  TraceGraph readGraph(const ordered_json& value, const std::string& ptr) {
    FieldReader r(value, ptr, diags_);
    TraceGraph graph;
    graph.id = r.integer("id", 0).value_or(-1);
    if (auto kind = r.oneOf("kind", {"forward", "backward"})) {
      graph.kind = *kind == "forward" ? GraphKind::Forward : GraphKind::Backward;
    }
    graph.inputShapes = r.inputShapes(graph.kind);
    if (auto* events = r.array("events")) {
      // Ops on one stream run in issue order, so their start times never decrease.
      std::map<std::string, double> lastStartByStream;
      for (size_t e = 0; e < events->size(); ++e) {
        graph.events.push_back(readEvent((*events)[e], ptr + "/events/" + std::to_string(e),
                                         static_cast<int64_t>(e), lastStartByStream));
      }
    }
    if (auto* saved = r.array("saved_activations", FieldReader::Optional)) {
      if (graph.kind != GraphKind::Forward) {
        diags_.add(r.pointerOf("saved_activations"),
                   "saved activations belong to forward graphs; this graph is a backward");
      } else {
        readSavedActivations(*saved, r.pointerOf("saved_activations"), graph);
      }
    }
    r.rejectUnknownFields();
    return graph;
  }

  /// A forward's saved_activations: each one's saves after the previous one's first, none twice,
  /// and its ops within the forward (a backward's ops are checked by the planner, which pairs them).
  void readSavedActivations(const ordered_json& list, const std::string& ptr, TraceGraph& graph) {
    const auto ops = static_cast<int64_t>(graph.events.size());
    std::set<int64_t> packs;
    int64_t lastFirst = -1;
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string at = ptr + "/" + std::to_string(i);
      FieldReader r(list[i], at, diags_);
      SavedActivation a;
      a.packs = r.integers("packs", 0).value_or(std::vector<int64_t>{});
      if (a.packs.empty() && r.isObject()) diags_.add(r.pointerOf("packs"), "expected at least one save");
      for (size_t k = 0; k < a.packs.size(); ++k) {
        const std::string packPtr = r.pointerOf("packs") + "/" + std::to_string(k);
        if (k > 0 && a.packs[k] <= a.packs[k - 1]) {
          diags_.add(packPtr, "expected the saves in increasing order, got " + std::to_string(a.packs[k]) +
                                  " after " + std::to_string(a.packs[k - 1]));
        } else if (!packs.insert(a.packs[k]).second) {
          diags_.add(packPtr,
                     "save " + std::to_string(a.packs[k]) + " belongs to an earlier saved activation too");
        }
      }
      if (!a.packs.empty()) {
        if (a.packs.front() <= lastFirst) {
          diags_.add(r.pointerOf("packs") + "/0",
                     "expected the activations in the order first saved: " + std::to_string(a.packs.front()) +
                         " after " + std::to_string(lastFirst));
        }
        lastFirst = a.packs.front();
      }
      a.bytes = r.bytes("bytes").value_or(0);
      if (a.bytes == 0 && r.isObject()) diags_.add(r.pointerOf("bytes"), "expected the storage's size, > 0");
      auto opWithin = [&](const char* key, FieldReader::Presence presence,
                          int64_t least) -> std::optional<int64_t> {
        auto v = r.integer(key, 0, presence);
        if (v && (*v < least || *v > ops)) {
          diags_.add(r.pointerOf(key), "expected an op of this forward from " + std::to_string(least) +
                                           " to " + std::to_string(ops) + " (its end), got " +
                                           std::to_string(*v));
          return std::nullopt;
        }
        return v;
      };
      a.seq = opWithin("seq", FieldReader::Required, 0).value_or(0);
      a.freedAt = opWithin("freed_at", FieldReader::Optional, a.seq);
      a.usedAt = r.integer("used_at", 0, FieldReader::Optional);
      r.rejectUnknownFields();
      graph.savedActivations.push_back(std::move(a));
    }
  }

  void checkParamId(int64_t id, const std::string& ptr) {
    if (paramTableValid_ && !paramIds_.count(id)) {
      diags_.add(ptr, "ds_id " + std::to_string(id) + " is not in the parameter table (/params)");
    }
  }

  OpEvent readEvent(const ordered_json& value, const std::string& ptr, int64_t position,
                    std::map<std::string, double>& lastStartByStream) {
    FieldReader r(value, ptr, diags_);
    OpEvent ev;
    if (auto seq = r.integer("seq", 0)) {
      if (*seq != position) {
        diags_.add(ptr + "/seq", "expected " + std::to_string(position) + " (the event's position), got " +
                                     std::to_string(*seq));
      }
      ev.seq = *seq;
    }
    IdArity arity = IdArity::None;
    if (auto op = r.string("op")) {
      const OpInfo* info = findOp(*op);
      if (!info) {
        diags_.add(ptr + "/op", "unknown op \"" + *op + "\" (expected one of " + opNames() + ")");
        // Which id fields an unknown op may carry is unknown: do not report them too.
        r.integer("ds_id", 0, P::Optional);
        r.integers("ds_ids", 0, P::Optional);
        r.integer("n_users", 1, P::Optional);
      } else {
        arity = info->ids;
      }
      ev.op = *op;
    }
    if (arity == IdArity::One || arity == IdArity::TensorId) {
      if (auto id = r.integer("ds_id", 0)) {
        if (arity == IdArity::One) checkParamId(*id, ptr + "/ds_id");
        ev.dsIds = {*id};
      }
    } else if (arity == IdArity::Many) {
      if (auto ids = r.integers("ds_ids", 0)) {
        if (ids->empty()) diags_.add(ptr + "/ds_ids", "expected at least one id");
        for (size_t k = 0; k < ids->size(); ++k)
          checkParamId((*ids)[k], ptr + "/ds_ids/" + std::to_string(k));
        ev.dsIds = *ids;
      }
    }
    if (ev.op == "release_param") ev.nUsers = r.integer("n_users", 1);
    ev.bytes = r.bytes("bytes").value_or(0);
    ev.dtype = r.dtype("dtype", P::Optional).value_or("");
    ev.stream = r.oneOf("stream", streamNames()).value_or("");
    auto start = r.number("start_us", 0);
    auto end = r.number("end_us", 0);
    ev.computeUs = r.number("compute_us", 0).value_or(0);
    ev.memoryBytes = r.bytes("memory_bytes").value_or(0);
    ev.peakBytes = r.bytes("peak_bytes", P::Optional).value_or(0);
    ev.hostUs = r.number("host_us", 0, P::Optional);
    ev.issueUs = r.number("issue_us", 0, P::Optional);
    ev.deviceUs = r.number("device_us", 0, P::Optional);
    ev.opDeviceUs = r.number("op_device_us", 0, P::Optional);
    if (ev.peakBytes != 0 && ev.peakBytes < ev.memoryBytes) {
      diags_.add(ptr + "/peak_bytes",
                 "peak_bytes (" + std::to_string(ev.peakBytes) + ") is below memory_bytes (" +
                     std::to_string(ev.memoryBytes) +
                     "): the peak since the previous op includes the bytes in use at this one");
    }
    r.rejectUnknownFields();
    if (start && end && *end < *start) {
      diags_.add(ptr + "/end_us", "end_us (" + ordered_json(*end).dump() + ") is before start_us (" +
                                      ordered_json(*start).dump() + ")");
    }
    if (start && !ev.stream.empty()) {
      auto [last, fresh] = lastStartByStream.emplace(ev.stream, *start);
      if (!fresh && *start < last->second) {
        diags_.add(ptr + "/start_us", "times must not go backwards on stream \"" + ev.stream +
                                          "\": start_us " + ordered_json(*start).dump() +
                                          " is before the previous " + ev.stream + " op's " +
                                          ordered_json(last->second).dump());
      }
      last->second = std::max(last->second, *start);
    }
    ev.startUs = start.value_or(0);
    ev.endUs = end.value_or(ev.startUs);
    return ev;
  }

  Trace& out_;
  Diagnostics diags_;
  std::optional<int64_t> worldSize_;
  std::set<int64_t> paramIds_;
  bool paramTableValid_ = false;
};

bool takesOneId(const std::string& op) {
  const OpInfo* info = findOp(op);
  return info && (info->ids == IdArity::One || info->ids == IdArity::TensorId);
}

}  // namespace

std::vector<Diagnostic> validateTrace(const ordered_json& doc, Trace& out) {
  Trace candidate;
  auto diags = TraceValidator(candidate).run(doc);
  if (diags.empty()) out = std::move(candidate);
  return diags;
}

Trace readTrace(const std::filesystem::path& path) {
  return readDocument<Trace>(path, DocumentKind::Trace, std::string("a trace (\"") + kTraceSchema + "\")",
                             validateTrace);
}

std::string writeTrace(const Trace& t) {
  ordered_json meta{{"created_by", t.meta.createdBy},
                    {"world_size", t.meta.worldSize},
                    {"backend", t.meta.backend},
                    {"device", t.meta.device},
                    {"stage", t.meta.stage},
                    {"grad_accum_steps", t.meta.gradAccumSteps},
                    {"param_dtype", t.meta.paramDtype},
                    {"reduce_dtype", t.meta.reduceDtype}};
  meta["versions"] = ordered_json::object();
  for (const auto& [k, v] : t.meta.versions) meta["versions"][k] = v;
  if (t.meta.replay != "eager") meta["replay"] = t.meta.replay;  // absent: eager, as before the field
  if (t.meta.graphed) meta["graphed"] = true;                    // absent: not graphed
  if (t.meta.checksCollectives) meta["checks_collectives"] = true;  // absent: the replay does not check

  ordered_json params = ordered_json::array();
  for (const auto& p : t.params) {
    ordered_json row{{"id", p.id},
                     {"name", p.name},
                     {"shape", p.shape},
                     {"dtype", p.dtype},
                     {"numel", p.numel},
                     {"shard_numel", p.shardNumel},
                     {"requires_grad", p.requiresGrad}};
    if (p.optimizerStateBytes) row["optimizer_state_bytes"] = *p.optimizerStateBytes;
    if (p.optimizerImpl) row["optimizer_impl"] = *p.optimizerImpl;
    if (p.optimizerGroup) row["optimizer_group"] = *p.optimizerGroup;
    params.push_back(std::move(row));
  }
  ordered_json calibration = calibrationJson(t.calibration);
  if (t.calibration.graphStepUs) calibration["graph_step_us"] = *t.calibration.graphStepUs;

  ordered_json steps = ordered_json::array();
  for (const auto& s : t.steps) {
    ordered_json graphs = ordered_json::array();
    for (const auto& g : s.graphs) {
      ordered_json events = ordered_json::array();
      for (const auto& e : g.events) {
        ordered_json ev{{"seq", e.seq}, {"op", e.op}};
        if (takesOneId(e.op) && !e.dsIds.empty())
          ev["ds_id"] = e.dsIds.front();
        else if (e.op == "prefetch_params_fused")
          ev["ds_ids"] = e.dsIds;
        if (e.nUsers) ev["n_users"] = *e.nUsers;
        ev["bytes"] = e.bytes;
        if (!e.dtype.empty()) ev["dtype"] = e.dtype;
        ev["stream"] = e.stream;
        ev["start_us"] = e.startUs;
        ev["end_us"] = e.endUs;
        ev["compute_us"] = e.computeUs;
        ev["memory_bytes"] = e.memoryBytes;
        if (e.peakBytes != 0) ev["peak_bytes"] = e.peakBytes;
        if (e.hostUs) ev["host_us"] = *e.hostUs;
        if (e.issueUs) ev["issue_us"] = *e.issueUs;
        if (e.deviceUs) ev["device_us"] = *e.deviceUs;
        if (e.opDeviceUs) ev["op_device_us"] = *e.opDeviceUs;
        events.push_back(std::move(ev));
      }
      ordered_json graph{{"id", g.id}, {"kind", graphKindName(g.kind)}};
      if (g.inputShapes) graph["input_shapes"] = *g.inputShapes;
      graph["events"] = std::move(events);
      if (!g.savedActivations.empty()) {
        ordered_json saved = ordered_json::array();
        for (const SavedActivation& a : g.savedActivations) {
          ordered_json entry{{"packs", a.packs}, {"bytes", a.bytes}, {"seq", a.seq}};
          if (a.freedAt) entry["freed_at"] = *a.freedAt;
          if (a.usedAt) entry["used_at"] = *a.usedAt;
          saved.push_back(std::move(entry));
        }
        graph["saved_activations"] = std::move(saved);
      }
      graphs.push_back(std::move(graph));
    }
    ordered_json step{{"index", s.index}, {"optimizer_us", s.optimizerUs}};
    if (s.optimizerHostUs) step["optimizer_host_us"] = *s.optimizerHostUs;
    if (s.optimizerDeviceUs) step["optimizer_device_us"] = *s.optimizerDeviceUs;
    step["graphs"] = std::move(graphs);
    steps.push_back(std::move(step));
  }

  ordered_json doc{
      {"schema", kTraceSchema},
      {"meta", std::move(meta)},
      {"memory", {{"capacity_bytes", t.memory.capacityBytes}, {"baseline_bytes", t.memory.baselineBytes}}},
      {"params", std::move(params)},
      {"calibration", std::move(calibration)},
      {"steps", std::move(steps)}};
  return doc.dump(2) + "\n";
}

std::string paramSignature(const std::vector<TraceParam>& params, int64_t worldSize) {
  std::vector<const TraceParam*> byId;
  for (const auto& p : params) byId.push_back(&p);
  std::sort(byId.begin(), byId.end(), [](auto* a, auto* b) { return a->id < b->id; });
  std::string text;
  for (const TraceParam* p : byId) {
    text += std::to_string(p->id) + "\t" + p->name + "\t";
    for (size_t i = 0; i < p->shape.size(); ++i) text += (i ? "x" : "") + std::to_string(p->shape[i]);
    text += "\t" + p->dtype + "\n";
  }
  text += "world_size\t" + std::to_string(worldSize) + "\n";
  return fnv1a64(text);
}

std::string traceDigest(const Trace& trace) { return fnv1a64(writeTrace(trace)); }

const char* streamName(Stream stream) {
  switch (stream) {
    case Stream::Compute:
      return "compute";
    case Stream::AllGather:
      return "allgather";
    case Stream::Reduce:
      return "reduce";
    case Stream::Copy:
      return "copy";
    case Stream::Offload:
      return "offload";
    case Stream::Reload:
      return "reload";
  }
  return "compute";
}

const std::vector<std::string>& streamNames() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (Stream s : {Stream::Compute, Stream::AllGather, Stream::Reduce, Stream::Copy, Stream::Offload,
                     Stream::Reload}) {
      out.emplace_back(streamName(s));
    }
    return out;
  }();
  return names;
}

std::string inputShapesText(const InputShapes& shapes) {
  std::string out = "[";
  for (size_t i = 0; i < shapes.size(); ++i) {
    if (i) out += ", ";
    out += "(";
    for (size_t d = 0; d < shapes[i].size(); ++d) out += (d ? ", " : "") + std::to_string(shapes[i][d]);
    if (shapes[i].size() == 1) out += ",";
    out += ")";
  }
  return out + "]";
}

}  // namespace dcplan::schemas
