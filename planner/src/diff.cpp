// Plan diff: matching graphs by id, prefetch groups by position, buckets by order.
#include "dcplan/planner/diff.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "dcplan/planner/units.h"
#include "dcplan/schemas/network.h"
#include "dcplan/schemas/units.h"

namespace dcplan::planner {
namespace {

const char* changeName(Change c) {
  switch (c) {
    case Change::Added:
      return "added";
    case Change::Removed:
      return "removed";
    case Change::Changed:
      return "changed";
  }
  return "?";
}

class Differ {
 public:
  Differ(double tolerance, PlanDiff& out) : tolerance_(tolerance), out_(out) {}

  void text(const std::string& path, const std::string& what, const std::string& a, const std::string& b,
            bool note = false) {
    if (a == b) return;
    PlanDifference d;
    d.path = path;
    d.what = what;
    d.textA = a;
    d.textB = b;
    (note ? out_.notes : out_.differences).push_back(std::move(d));
  }

  void exact(const std::string& path, const std::string& what, double a, double b) {
    if (a == b) return;
    push(path, what, a, b);
  }

  void predicted(const std::string& path, const std::string& what, double a, double b) {
    double scale = std::max(std::fabs(a), std::fabs(b));
    if (std::fabs(a - b) <= tolerance_ * scale || a == b) return;
    push(path, what, a, b);
  }

  void ids(const std::string& path, const std::string& what, Change change,
           std::optional<std::vector<int64_t>> a, std::optional<std::vector<int64_t>> b) {
    PlanDifference d;
    d.path = path;
    d.what = what;
    d.change = change;
    d.idsA = std::move(a);
    d.idsB = std::move(b);
    out_.differences.push_back(std::move(d));
  }

  void withBytes(PlanDifference d) { out_.differences.push_back(std::move(d)); }

 private:
  void push(const std::string& path, const std::string& what, double a, double b) {
    PlanDifference d;
    d.path = path;
    d.what = what;
    d.numberA = a;
    d.numberB = b;
    out_.differences.push_back(std::move(d));
  }

  double tolerance_;
  PlanDiff& out_;
};

/// A plan's --network as diff names it: its file, ranks and transport, or "none".
std::string networkText(const std::optional<schemas::PlanNetwork>& n) {
  return n ? n->file + " (" + std::to_string(n->measured.worldSize) + " ranks, " + n->measured.backend + ")"
           : "none";
}

std::string optNumber(const std::optional<double>& v) {
  if (!v) return "none";
  std::ostringstream s;
  s << *v;
  return s.str();
}

std::string graphLabel(const schemas::PlanGraph& g) {
  return "graph " + std::to_string(g.id) + " (" + schemas::graphKindName(g.kind) + ")";
}

void diffGraph(Differ& d, const schemas::PlanGraph& a, const schemas::PlanGraph& b, size_t ia, size_t ib) {
  std::string label = graphLabel(a);
  std::string pa = "/graphs/" + std::to_string(ia), pb = "/graphs/" + std::to_string(ib);
  if (a.kind != b.kind) {
    d.text(pa + "/kind", label + " kind", schemas::graphKindName(a.kind), schemas::graphKindName(b.kind));
  }
  if (a.inputShapes != b.inputShapes) {  // plans of recordings with other batches
    auto text = [](const auto& shapes) -> std::string {
      return shapes ? schemas::inputShapesText(*shapes) : "not recorded";
    };
    d.text(pb + "/input_shapes", label + " recorded inputs", text(a.inputShapes), text(b.inputShapes));
  }
  // Saved activations kept on the host, by first save.
  auto packs = [](const schemas::PlanGraph& g) {
    std::vector<int64_t> out;
    for (const auto& o : g.offloadSaves) out.push_back(o.pack);
    return out;
  };
  const std::vector<int64_t> sa = packs(a), sb = packs(b);
  std::vector<int64_t> movedIn, movedOut;
  std::set_difference(sb.begin(), sb.end(), sa.begin(), sa.end(), std::back_inserter(movedIn));
  std::set_difference(sa.begin(), sa.end(), sb.begin(), sb.end(), std::back_inserter(movedOut));
  if (!movedIn.empty())
    d.ids(pb + "/offload_saves", label + " offloaded saves", Change::Added, std::nullopt, movedIn);
  if (!movedOut.empty())
    d.ids(pa + "/offload_saves", label + " offloaded saves", Change::Removed, movedOut, std::nullopt);
  // Prefetch groups by position; several groups at one position compare in order.
  std::map<int64_t, std::vector<std::pair<size_t, const schemas::PrefetchGroup*>>> ga, gb;
  for (size_t i = 0; i < a.prefetch.size(); ++i) ga[a.prefetch[i].position].emplace_back(i, &a.prefetch[i]);
  for (size_t i = 0; i < b.prefetch.size(); ++i) gb[b.prefetch[i].position].emplace_back(i, &b.prefetch[i]);
  std::set<int64_t> positions;
  for (const auto& [p, _] : ga) positions.insert(p);
  for (const auto& [p, _] : gb) positions.insert(p);
  for (int64_t pos : positions) {
    const auto& la = ga[pos];
    const auto& lb = gb[pos];
    for (size_t k = 0; k < std::max(la.size(), lb.size()); ++k) {
      std::string what = label + " prefetch @" + std::to_string(pos);
      if (k >= la.size()) {
        d.ids(pb + "/prefetch/" + std::to_string(lb[k].first), what, Change::Added, std::nullopt,
              lb[k].second->dsIds);
      } else if (k >= lb.size()) {
        d.ids(pa + "/prefetch/" + std::to_string(la[k].first), what, Change::Removed, la[k].second->dsIds,
              std::nullopt);
      } else if (la[k].second->dsIds != lb[k].second->dsIds) {
        d.ids(pb + "/prefetch/" + std::to_string(lb[k].first), what, Change::Changed, la[k].second->dsIds,
              lb[k].second->dsIds);
      }
    }
  }
  for (size_t k = 0; k < std::max(a.buckets.size(), b.buckets.size()); ++k) {
    std::string what = label + " bucket " + std::to_string(k);
    PlanDifference diff;
    diff.what = what;
    if (k >= a.buckets.size()) {
      diff.path = pb + "/buckets/" + std::to_string(k);
      diff.change = Change::Added;
      diff.idsB = b.buckets[k].dsIds;
      diff.numberB = static_cast<double>(b.buckets[k].bytes);
    } else if (k >= b.buckets.size()) {
      diff.path = pa + "/buckets/" + std::to_string(k);
      diff.change = Change::Removed;
      diff.idsA = a.buckets[k].dsIds;
      diff.numberA = static_cast<double>(a.buckets[k].bytes);
    } else if (a.buckets[k].dsIds != b.buckets[k].dsIds || a.buckets[k].bytes != b.buckets[k].bytes ||
               a.buckets[k].dtype != b.buckets[k].dtype) {
      diff.path = pb + "/buckets/" + std::to_string(k);
      diff.idsA = a.buckets[k].dsIds;
      diff.idsB = b.buckets[k].dsIds;
      diff.numberA = static_cast<double>(a.buckets[k].bytes);
      diff.numberB = static_cast<double>(b.buckets[k].bytes);
      diff.textA = a.buckets[k].dtype;
      diff.textB = b.buckets[k].dtype;
    } else {
      continue;
    }
    d.withBytes(std::move(diff));
  }
}

void diffPrediction(Differ& d, const std::string& path, const std::string& label,
                    const schemas::Prediction& a, const schemas::Prediction& b) {
  d.predicted(path + "/step_us", label + " step_us", a.stepUs, b.stepUs);
  d.predicted(path + "/exposed_comm_us", label + " exposed_comm_us", a.exposedCommUs, b.exposedCommUs);
  d.predicted(path + "/peak_memory_bytes", label + " peak_memory_bytes",
              static_cast<double>(a.peakMemoryBytes), static_cast<double>(b.peakMemoryBytes));
  if (a.offloadBytes > 0 || b.offloadBytes > 0) {
    d.predicted(path + "/offload_bytes", label + " offload_bytes", static_cast<double>(a.offloadBytes),
                static_cast<double>(b.offloadBytes));
    d.predicted(path + "/exposed_copy_us", label + " exposed_copy_us", a.exposedCopyUs, b.exposedCopyUs);
  }
  if (a.activationOffloadBytes > 0 || b.activationOffloadBytes > 0) {
    d.predicted(path + "/activation_offload_bytes", label + " activation_offload_bytes",
                static_cast<double>(a.activationOffloadBytes), static_cast<double>(b.activationOffloadBytes));
    d.predicted(path + "/activation_copy_us", label + " activation_copy_us", a.activationCopyUs,
                b.activationCopyUs);
  }
  if (a.copyBoundUs > 0 || b.copyBoundUs > 0)
    d.predicted(path + "/copy_bound_us", label + " copy_bound_us", a.copyBoundUs, b.copyBoundUs);
}

/// Which parameters' optimizer state each plan keeps on the host, and in how many groups.
void diffOffload(Differ& d, const std::vector<schemas::OffloadGroup>& a,
                 const std::vector<schemas::OffloadGroup>& b) {
  // masters: only the groups whose master shards are offloaded too.
  auto ids = [](const std::vector<schemas::OffloadGroup>& groups, bool masters) {
    std::vector<int64_t> out;
    for (const auto& g : groups) {
      if (!masters || g.masterBytes > 0) out.insert(out.end(), g.dsIds.begin(), g.dsIds.end());
    }
    std::sort(out.begin(), out.end());
    return out;
  };
  const std::string path = "/offload/optimizer_state";
  for (bool masters : {false, true}) {
    const std::vector<int64_t> ia = ids(a, masters), ib = ids(b, masters);
    std::vector<int64_t> added, removed;
    std::set_difference(ib.begin(), ib.end(), ia.begin(), ia.end(), std::back_inserter(added));
    std::set_difference(ia.begin(), ia.end(), ib.begin(), ib.end(), std::back_inserter(removed));
    const char* what = masters ? "offloaded master shards" : "offloaded optimizer state";
    if (!added.empty()) d.ids(path, what, Change::Added, std::nullopt, added);
    if (!removed.empty()) d.ids(path, what, Change::Removed, removed, std::nullopt);
  }
  d.exact(path, "offload groups", static_cast<double>(a.size()), static_cast<double>(b.size()));
}

}  // namespace

std::string formatIds(const std::vector<int64_t>& ids) {
  std::string out;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (!out.empty()) out += ' ';
    out += std::to_string(ids[i]);
    if (j > i) out += "-" + std::to_string(ids[j]);
    i = j + 1;
  }
  return out;
}

PlanDiff diffPlans(const schemas::Plan& a, const schemas::Plan& b, double tolerance) {
  PlanDiff out;
  Differ d(tolerance, out);
  d.text("/source/param_signature", "source.param_signature", a.source.paramSignature,
         b.source.paramSignature);
  d.exact("/source/world_size", "source.world_size", static_cast<double>(a.source.worldSize),
          static_cast<double>(b.source.worldSize));
  d.exact("/source/stage", "source.stage", static_cast<double>(a.source.stage),
          static_cast<double>(b.source.stage));
  d.text("/source/replay", "source.replay", a.source.replay, b.source.replay);
  d.text("/options/strategy", "options.strategy", a.options.strategy, b.options.strategy);
  d.text("/options/memory_budget_bytes", "options.memory_budget_bytes",
         a.options.memoryBudgetBytes ? std::to_string(*a.options.memoryBudgetBytes) : "none",
         b.options.memoryBudgetBytes ? std::to_string(*b.options.memoryBudgetBytes) : "none");
  d.text("/options/bandwidth_gbps", "options.bandwidth_gbps", optNumber(a.options.bandwidthGBps),
         optNumber(b.options.bandwidthGBps));
  d.exact("/options/grad_accum_steps", "options.grad_accum_steps",
          static_cast<double>(a.options.gradAccumSteps), static_cast<double>(b.options.gradAccumSteps));
  d.text("/options/cuda_graph", "options.cuda_graph", a.options.cudaGraph ? "true" : "false",
         b.options.cudaGraph ? "true" : "false");
  d.text("/options/device_times", "options.device_times", a.options.deviceTimes ? "true" : "false",
         b.options.deviceTimes ? "true" : "false");
  const auto& na = a.options.network;
  const auto& nb = b.options.network;
  const bool sameNetwork =
      na.has_value() == nb.has_value() && (!na || schemas::sameCollectives(na->measured, nb->measured));
  const std::string textA = networkText(na), textB = networkText(nb);
  d.text("/options/network", "options.network", textA,
         textB + (!sameNetwork && textA == textB ? ", other times" : ""));
  d.text("/options/in_situ_scale", "options.in_situ_scale", optNumber(a.options.inSituScale),
         optNumber(b.options.inSituScale), true);
  d.text("/options/host_scale", "options.host_scale", optNumber(a.options.hostScale),
         optNumber(b.options.hostScale), true);
  d.text("/options/device_scale", "options.device_scale", optNumber(a.options.deviceScale),
         optNumber(b.options.deviceScale), true);
  // Provenance: the same schedule from a re-recorded trace or a newer dcplan is the same plan.
  d.text("/source/trace_digest", "source.trace_digest", a.source.traceDigest, b.source.traceDigest, true);
  d.text("/source/trace", "source.trace", a.source.trace, b.source.trace, true);
  d.text("/created_by", "created_by", a.createdBy, b.createdBy, true);

  std::vector<int64_t> added, removed;
  std::set_difference(b.persistent.begin(), b.persistent.end(), a.persistent.begin(), a.persistent.end(),
                      std::back_inserter(added));
  std::set_difference(a.persistent.begin(), a.persistent.end(), b.persistent.begin(), b.persistent.end(),
                      std::back_inserter(removed));
  if (!added.empty()) d.ids("/persistent", "persistent", Change::Added, std::nullopt, added);
  if (!removed.empty()) d.ids("/persistent", "persistent", Change::Removed, removed, std::nullopt);

  for (size_t ia = 0; ia < a.graphs.size(); ++ia) {
    size_t ib = 0;
    while (ib < b.graphs.size() && b.graphs[ib].id != a.graphs[ia].id) ++ib;
    if (ib == b.graphs.size()) {
      d.text("/graphs/" + std::to_string(ia), graphLabel(a.graphs[ia]), "present", "absent");
    } else {
      diffGraph(d, a.graphs[ia], b.graphs[ib], ia, ib);
    }
  }
  for (size_t ib = 0; ib < b.graphs.size(); ++ib) {
    bool inA =
        std::any_of(a.graphs.begin(), a.graphs.end(), [&](const auto& g) { return g.id == b.graphs[ib].id; });
    if (!inA) d.text("/graphs/" + std::to_string(ib), graphLabel(b.graphs[ib]), "absent", "present");
  }
  diffOffload(d, a.optimizerOffload, b.optimizerOffload);
  diffPrediction(d, "/predicted", "predicted", a.predicted, b.predicted);
  diffPrediction(d, "/predicted_default", "predicted_default", a.predictedDefault, b.predictedDefault);
  return out;
}

std::string renderDiffText(const PlanDiff& diff, const std::string& nameA, const std::string& nameB) {
  std::ostringstream s;
  s << "--- " << nameA << "\n+++ " << nameB << "\n";
  auto value = [](const std::optional<std::vector<int64_t>>& ids, const std::optional<double>& number,
                  const std::string& text, bool bytes) {
    std::string out;
    if (ids) out = "[" + formatIds(*ids) + "]";
    if (number) {
      std::string n = bytes ? schemas::formatBytes(static_cast<uint64_t>(*number)) : formatFixed(*number, 3);
      out += out.empty() ? n : " " + n;
    }
    if (!text.empty()) out += out.empty() ? text : " " + text;
    return out;
  };
  for (const PlanDifference& d : diff.differences) {
    bool bytes = d.what.find("bucket") != std::string::npos || d.what.find("bytes") != std::string::npos;
    std::string a = value(d.idsA, d.numberA, d.textA, bytes);
    std::string b = value(d.idsB, d.numberB, d.textB, bytes);
    switch (d.change) {
      case Change::Added:
        s << "+ " << d.what << ": " << b << "\n";
        break;
      case Change::Removed:
        s << "- " << d.what << ": " << a << "\n";
        break;
      case Change::Changed: {
        s << "~ " << d.what << ": " << a << " -> " << b;
        if (d.numberA && d.numberB && !d.idsA) s << " (" << formatChange(*d.numberA, *d.numberB) << ")";
        s << "\n";
        break;
      }
    }
  }
  for (const PlanDifference& d : diff.notes)
    s << "  note: " << d.what << ": " << d.textA << " -> " << d.textB << "\n";
  if (diff.equal()) {
    s << "plans are equal\n";
  } else {
    s << diff.differences.size() << (diff.differences.size() == 1 ? " difference\n" : " differences\n");
  }
  return s.str();
}

std::string renderDiffJson(const PlanDiff& diff, const std::string& nameA, const std::string& nameB,
                           double tolerance) {
  using nlohmann::ordered_json;
  auto item = [](const PlanDifference& d) {
    ordered_json j;
    j["path"] = d.path;
    j["change"] = changeName(d.change);
    j["what"] = d.what;
    auto side = [&](const char* key, const std::optional<std::vector<int64_t>>& ids,
                    const std::optional<double>& n, const std::string& text) {
      if (!ids && !n && text.empty()) return;
      ordered_json v = ordered_json::object();
      if (ids) v["ds_ids"] = *ids;
      if (n) v["value"] = *n;
      if (!text.empty()) v["text"] = text;
      j[key] = std::move(v);
    };
    side("a", d.idsA, d.numberA, d.textA);
    side("b", d.idsB, d.numberB, d.textB);
    return j;
  };
  ordered_json out;
  out["equal"] = diff.equal();
  out["a"] = nameA;
  out["b"] = nameB;
  out["tolerance"] = tolerance;
  out["differences"] = ordered_json::array();
  for (const auto& d : diff.differences) out["differences"].push_back(item(d));
  out["notes"] = ordered_json::array();
  for (const auto& d : diff.notes) out["notes"].push_back(item(d));
  return out.dump(2) + "\n";
}

}  // namespace dcplan::planner
