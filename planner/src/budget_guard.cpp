// The memory held by a plan's choices that hold a copy ahead of its use (budget_guard.h).
#include "dcplan/planner/budget_guard.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <vector>

namespace dcplan::planner {

namespace {

bool gathers(const WorkOp& op, int32_t param) {
  return op.param == param && (op.role == OpRole::Gather || op.role == OpRole::GatherWait);
}

/// The position of the op of `ops` that gathers param at or after op index `from` (the op that
/// uses a prefetched copy first); the last op's position where none does.
int64_t gatheredAt(const std::vector<WorkOp>& ops, size_t from, int32_t param) {
  for (size_t j = from; j < ops.size(); ++j) {
    if (gathers(ops[j], param)) return ops[j].seq;
  }
  return ops.back().seq;
}

/// The simulation's memory samples per run (those at or before an op).
struct Samples {
  std::vector<std::vector<const MemorySample*>> ofRun;

  Samples(const Workload& w, const SimResult& sim) : ofRun(w.runs.size()) {
    for (const MemorySample& m : sim.memory) {
      if (m.run >= 0 && m.seq >= 0) ofRun[static_cast<size_t>(m.run)].push_back(&m);
    }
  }

  /// The most memory of run r after a launch before the op at position `from` (the compute
  /// before that op is not after it) up to the op at position `until`.
  uint64_t peak(size_t r, int64_t from, int64_t until) const {
    uint64_t out = 0;
    for (const MemorySample* m : ofRun[r]) {
      if ((m->atOp ? m->seq >= from : m->seq > from) && m->seq <= until) out = std::max(out, m->bytes);
    }
    return out;
  }
};

const std::vector<WorkOp>& opsOf(const Workload& w, size_t r) {
  return w.graphs[static_cast<size_t>(w.runs[r].graph)].ops;
}

void setPrefetchPeaks(const Workload& w, const Samples& at, std::vector<schemas::PlanGraph>& graphs) {
  std::map<int64_t, schemas::PlanGraph*> planned;
  for (schemas::PlanGraph& g : graphs) planned[g.id] = &g;
  for (size_t r = 0; r < w.runs.size(); ++r) {
    const std::vector<WorkOp>& ops = opsOf(w, r);
    const auto it = planned.find(w.graphs[static_cast<size_t>(w.runs[r].graph)].id);
    if (it == planned.end()) continue;
    for (schemas::PrefetchGroup& group : it->second->prefetch) {
      const auto op = std::lower_bound(ops.begin(), ops.end(), group.position,
                                       [](const WorkOp& o, int64_t pos) { return o.seq < pos; });
      if (op == ops.end() || op->seq != group.position) continue;  // compileSchedule refuses it
      int64_t until = group.position;
      for (int64_t id : group.dsIds)
        until = std::max(until, gatheredAt(ops, static_cast<size_t>(op - ops.begin()), w.paramIndex(id)));
      group.peakBytes = std::max(group.peakBytes.value_or(0), at.peak(r, group.position, until));
    }
  }
}

/// The most memory held from param's release at op i of run r until a later op of the step
/// gathers it again; 0 where none does.
uint64_t keptPeak(const Workload& w, const Samples& at, int32_t param, size_t r, size_t i) {
  const int64_t from = opsOf(w, r)[i].seq;
  uint64_t peak = 0;
  for (size_t k = r, j = i + 1; k < w.runs.size(); ++k, j = 0) {
    const std::vector<WorkOp>& ops = opsOf(w, k);
    while (j < ops.size() && !gathers(ops[j], param)) ++j;
    const bool found = j < ops.size();
    peak = std::max(peak, at.peak(k, k == r ? from : -1, found ? ops[j].seq : ops.back().seq));
    if (found) return peak;
  }
  return 0;  // not used again this step: ZeRO-3 drops it at the backward's end
}

}  // namespace

void setGuardPeaks(const Workload& w, const SimResult& sim, schemas::Plan& plan) {
  const Samples at(w, sim);
  if (sim.entryBytes.empty() || at.ofRun.empty())
    throw std::logic_error("setGuardPeaks: the simulation was not recorded (SimOptions::record)");
  setPrefetchPeaks(w, at, plan.graphs);
  schemas::Plan::Guard guard;
  guard.startBytes = sim.entryBytes.front();
  // The runtime keeps a frozen persistent copy from one step to the next (its shard does not
  // change); the simulated step gathers it anew.
  for (int64_t id : plan.persistent) {
    const WorkParam& p = w.params[static_cast<size_t>(w.paramIndex(id))];
    if (!p.requiresGrad) guard.startBytes += p.mem.gathered;
  }
  for (int64_t id : plan.persistent) {
    uint64_t peak = 0;
    const int32_t p = w.paramIndex(id);
    for (size_t r = 0; w.stage == 3 && r < w.runs.size(); ++r) {  // ZeRO-1/2 keep copies by stage
      const std::vector<WorkOp>& ops = opsOf(w, r);
      for (size_t i = 0; i < ops.size(); ++i) {
        if (ops[i].param == p && ops[i].role == OpRole::Release)
          peak = std::max(peak, keptPeak(w, at, p, r, i));
      }
    }
    guard.persistentPeakBytes.push_back(peak);
  }
  plan.guard = std::move(guard);
}

}  // namespace dcplan::planner
