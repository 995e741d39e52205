// Merging per-rank traces: agreement checks first, then timings as the max over ranks.
#include "dcplan/schemas/trace_merge.h"

#include <algorithm>
#include <map>
#include <optional>

#include "dcplan/schemas/io.h"

namespace dcplan::schemas {

std::string describeOp(const OpEvent& event) {
  std::string ids;
  for (size_t i = 0; i < event.dsIds.size(); ++i) ids += (i ? "," : "") + std::to_string(event.dsIds[i]);
  if (event.dsIds.empty()) return event.op + "()";
  return event.op + (event.dsIds.size() == 1 ? "(ds_id " : "(ds_ids ") + ids + ")";
}

namespace {

[[noreturn]] void disagree(const RankTrace& r, const std::string& pointer, const std::string& what) {
  throw InputError(r.file, {{pointer, what}});
}

template <typename T>
void requireSame(const RankTrace& base, const RankTrace& r, const std::string& pointer, const T& a,
                 const T& b) {
  if (a == b) return;
  auto str = [](const auto& v) {
    if constexpr (std::is_same_v<std::decay_t<decltype(v)>, std::string>)
      return "\"" + v + "\"";
    else
      return std::to_string(v);
  };
  disagree(r, pointer,
           "rank " + std::to_string(r.rank) + " has " + str(b) + " where rank " + std::to_string(base.rank) +
               " has " + str(a));
}

void checkAgreement(const RankTrace& base, const RankTrace& r) {
  const Trace& a = base.trace;
  const Trace& b = r.trace;
  requireSame(base, r, "/meta/world_size", a.meta.worldSize, b.meta.worldSize);
  requireSame(base, r, "/meta/backend", a.meta.backend, b.meta.backend);
  requireSame(base, r, "/meta/stage", a.meta.stage, b.meta.stage);
  requireSame(base, r, "/meta/replay", a.meta.replay, b.meta.replay);
  requireSame(base, r, "/meta/graphed", a.meta.graphed, b.meta.graphed);
  requireSame(base, r, "/meta/checks_collectives", a.meta.checksCollectives, b.meta.checksCollectives);
  requireSame(base, r, "/meta/grad_accum_steps", a.meta.gradAccumSteps, b.meta.gradAccumSteps);
  requireSame(base, r, "/meta/param_dtype", a.meta.paramDtype, b.meta.paramDtype);
  requireSame(base, r, "/meta/reduce_dtype", a.meta.reduceDtype, b.meta.reduceDtype);
  requireSame(base, r, "/params (count)", a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) {
    const std::string at = "/params/" + std::to_string(i);
    requireSame(base, r, at + "/id", a.params[i].id, b.params[i].id);
    requireSame(base, r, at + "/name", a.params[i].name, b.params[i].name);
    requireSame(base, r, at + "/numel", a.params[i].numel, b.params[i].numel);
    requireSame(base, r, at + "/dtype", a.params[i].dtype, b.params[i].dtype);
  }
  requireSame(base, r, "/steps (count)", a.steps.size(), b.steps.size());
  for (size_t s = 0; s < a.steps.size(); ++s) {
    const std::string stepAt = "/steps/" + std::to_string(s);
    requireSame(base, r, stepAt + "/graphs (count)", a.steps[s].graphs.size(), b.steps[s].graphs.size());
    for (size_t g = 0; g < a.steps[s].graphs.size(); ++g) {
      const TraceGraph& ga = a.steps[s].graphs[g];
      const TraceGraph& gb = b.steps[s].graphs[g];
      const std::string graphAt = stepAt + "/graphs/" + std::to_string(g);
      requireSame(base, r, graphAt + "/id", ga.id, gb.id);
      const std::string where = " (step " + std::to_string(a.steps[s].index) + ", " + graphKindName(ga.kind) +
                                " graph " + std::to_string(ga.id) + ", position ";
      const size_t common = std::min(ga.events.size(), gb.events.size());
      for (size_t e = 0; e < common; ++e) {
        const OpEvent& ea = ga.events[e];
        const OpEvent& eb = gb.events[e];
        if (ea.op != eb.op || ea.dsIds != eb.dsIds) {
          disagree(r, graphAt + "/events/" + std::to_string(e),
                   "rank " + std::to_string(r.rank) + " issued " + describeOp(eb) + " where rank " +
                       std::to_string(base.rank) + " issued " + describeOp(ea) + where + std::to_string(e) +
                       ")");
        }
      }
      if (ga.events.size() != gb.events.size()) {
        const bool shorter = gb.events.size() < ga.events.size();
        const OpEvent& extra = shorter ? ga.events[common] : gb.events[common];
        disagree(r, graphAt + "/events/" + std::to_string(common),
                 "rank " + std::to_string(shorter ? base.rank : r.rank) + " issued " + describeOp(extra) +
                     " where rank " + std::to_string(shorter ? r.rank : base.rank) + " ended the graph" +
                     where + std::to_string(common) + ")");
      }
    }
  }
}

/// The slower rank's time (host or device lead); absent when a rank did not record it (an older
/// recorder, a rank without a device lead).
std::optional<double> slowest(std::optional<double> a, std::optional<double> b) {
  if (!a || !b) return std::nullopt;
  return std::max(*a, *b);
}

/// A forward's saved activations over two ranks: those both saved alike (the same saves, of the same
/// size), first saved by the earlier op, gone by the later one and read by the earlier one (absent
/// where either rank lacks it), so that the plan's model of them holds on every rank.
void mergeSaved(std::vector<SavedActivation>& into, const std::vector<SavedActivation>& other) {
  std::map<std::vector<int64_t>, const SavedActivation*> byPacks;
  for (const SavedActivation& a : other) byPacks[a.packs] = &a;
  std::vector<SavedActivation> alike;
  for (SavedActivation& a : into) {
    const auto it = byPacks.find(a.packs);
    if (it == byPacks.end() || it->second->bytes != a.bytes) continue;
    const SavedActivation& o = *it->second;
    a.seq = std::min(a.seq, o.seq);
    a.freedAt =
        a.freedAt && o.freedAt ? std::optional<int64_t>(std::max(*a.freedAt, *o.freedAt)) : std::nullopt;
    a.usedAt = a.usedAt && o.usedAt ? std::optional<int64_t>(std::min(*a.usedAt, *o.usedAt)) : std::nullopt;
    alike.push_back(std::move(a));
  }
  into = std::move(alike);
}

void mergeCurve(std::vector<CalibrationPoint>& into, const std::vector<CalibrationPoint>& other) {
  if (into.size() != other.size()) return;  // measured at other sizes: keep rank 0's
  for (size_t i = 0; i < into.size(); ++i) {
    if (into[i].bytes != other[i].bytes) continue;
    into[i].us = std::max(into[i].us, other[i].us);
    into[i].deviceUs = slowest(into[i].deviceUs, other[i].deviceUs);
  }
}

}  // namespace

Trace mergeRankTraces(const std::vector<RankTrace>& input) {
  if (input.empty()) throw InputError("(record)", {{"", "no rank traces to merge"}});
  std::vector<const RankTrace*> ranks;
  for (const auto& r : input) ranks.push_back(&r);
  std::sort(ranks.begin(), ranks.end(), [](auto* a, auto* b) { return a->rank < b->rank; });
  const RankTrace& base = *ranks.front();
  const int64_t worldSize = base.trace.meta.worldSize;
  // Every rank exactly once.
  std::string missing;
  std::map<int64_t, const RankTrace*> byRank;
  for (const RankTrace* r : ranks) {
    if (!byRank.emplace(r->rank, r).second) {
      throw InputError(r->file, {{"", "rank " + std::to_string(r->rank) + " has two traces (also " +
                                          byRank[r->rank]->file + ")"}});
    }
    if (r->rank < 0 || r->rank >= worldSize) {
      throw InputError(r->file, {{"", "rank " + std::to_string(r->rank) + " is outside world size " +
                                          std::to_string(worldSize)}});
    }
  }
  for (int64_t rank = 0; rank < worldSize; ++rank) {
    if (!byRank.count(rank)) missing += (missing.empty() ? "" : ", ") + std::to_string(rank);
  }
  if (!missing.empty()) {
    throw InputError(base.file,
                     {{"", "no trace from rank " + missing + " (world size " + std::to_string(worldSize) +
                               "): that rank did not finish recording"}});
  }

  Trace merged = base.trace;
  for (const RankTrace* r : ranks) {
    if (r == &base) continue;
    checkAgreement(base, *r);
    const Trace& t = r->trace;
    merged.memory.baselineBytes = std::max(merged.memory.baselineBytes, t.memory.baselineBytes);
    merged.memory.capacityBytes = std::min(merged.memory.capacityBytes, t.memory.capacityBytes);
    mergeCurve(merged.calibration.allGather, t.calibration.allGather);
    mergeCurve(merged.calibration.reduceScatter, t.calibration.reduceScatter);
    mergeCurve(merged.calibration.allReduce, t.calibration.allReduce);
    merged.calibration.computeProbeUs =
        slowest(merged.calibration.computeProbeUs, t.calibration.computeProbeUs);
    merged.calibration.graphStepUs = slowest(merged.calibration.graphStepUs, t.calibration.graphStepUs);
    for (size_t s = 0; s < merged.steps.size(); ++s) {
      TraceStep& ms = merged.steps[s];
      ms.optimizerUs = std::max(ms.optimizerUs, t.steps[s].optimizerUs);
      ms.optimizerHostUs = slowest(ms.optimizerHostUs, t.steps[s].optimizerHostUs);
      ms.optimizerDeviceUs = slowest(ms.optimizerDeviceUs, t.steps[s].optimizerDeviceUs);
      for (size_t g = 0; g < ms.graphs.size(); ++g) {
        mergeSaved(ms.graphs[g].savedActivations, t.steps[s].graphs[g].savedActivations);
        for (size_t e = 0; e < ms.graphs[g].events.size(); ++e) {
          OpEvent& m = ms.graphs[g].events[e];
          const OpEvent& o = t.steps[s].graphs[g].events[e];
          m.startUs = std::max(m.startUs, o.startUs);
          m.endUs = std::max(m.endUs, o.endUs);
          m.computeUs = std::max(m.computeUs, o.computeUs);
          m.memoryBytes = std::max(m.memoryBytes, o.memoryBytes);
          m.peakBytes = std::max(m.peakBytes, o.peakBytes);
          m.hostUs = slowest(m.hostUs, o.hostUs);
          m.issueUs = slowest(m.issueUs, o.issueUs);
          m.deviceUs = slowest(m.deviceUs, o.deviceUs);
          m.opDeviceUs = slowest(m.opDeviceUs, o.opDeviceUs);
        }
      }
    }
  }
  return merged;
}

}  // namespace dcplan::schemas
