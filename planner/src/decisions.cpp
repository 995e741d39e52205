// The planning passes: stall-free views, bucket boundaries, prefetch issue points, persistence.
#include "decisions.h"

#include "dcplan/planner/planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace dcplan::planner::detail {
namespace {

/// Gradients of a graph in ready order: (op index, param), each param once.
std::vector<std::pair<int32_t, int32_t>> gradients(const Workload& w, int32_t g) {
  std::vector<std::pair<int32_t, int32_t>> out;
  std::vector<char> seen(w.params.size(), 0);
  const WorkGraph& graph = w.graphs[static_cast<size_t>(g)];
  for (size_t i = 0; i < graph.ops.size(); ++i) {
    const WorkOp& op = graph.ops[i];
    if (op.role != OpRole::ReduceGrad || seen[static_cast<size_t>(op.param)]) continue;
    seen[static_cast<size_t>(op.param)] = 1;
    out.emplace_back(static_cast<int32_t>(i), op.param);
  }
  return out;
}

schemas::PlanBucket makeBucket(const Context& c, const std::vector<int32_t>& params) {
  schemas::PlanBucket b;
  b.dtype = c.w.reduceDtype;
  for (int32_t p : params) {
    b.dsIds.push_back(c.w.params[static_cast<size_t>(p)].id);
    b.bytes += c.w.params[static_cast<size_t>(p)].gradBytes;
  }
  return b;
}

}  // namespace

Context makeContext(const Workload& w, const CostModel& cost, uint64_t limit) {
  Context c{w, cost, limit, {}, w.stage >= 2 ? Collective::ReduceScatter : Collective::AllReduce, {}, {}};
  c.views.resize(w.graphs.size());
  std::vector<char> seen(w.graphs.size(), 0);
  for (size_t r = 0; r < w.runs.size(); ++r) {
    const GraphRun& run = w.runs[r];
    GraphView& v = c.views[static_cast<size_t>(run.graph)];
    if (!seen[static_cast<size_t>(run.graph)]) {
      seen[static_cast<size_t>(run.graph)] = 1;
      v.graph = run.graph;
      v.run = static_cast<int32_t>(r);
      // When each op is reached: the compute before it, or with a host lane the longer of
      // its device and host time, plus the ops' own host time.
      double t = 0;
      for (size_t i = 0; i < run.computeUs.size(); ++i) {
        t += w.hostLane ? std::max(run.computeUs[i], run.hostUs[i]) : run.computeUs[i];
        v.issueUs.push_back(t);
        if (w.hostLane) t += run.issueUs[i];
      }
    }
  }
  return c;
}

// ---- buckets -----------------------------------------------------------------

BucketSet greedyBuckets(const Context& c, uint64_t capBytes) {
  BucketSet out(c.w.graphs.size());
  for (size_t g = 0; g < c.w.graphs.size(); ++g) {
    std::vector<int32_t> cur;
    uint64_t bytes = 0;
    for (const auto& [op, p] : gradients(c.w, static_cast<int32_t>(g))) {
      uint64_t b = c.w.params[static_cast<size_t>(p)].gradBytes;
      if (flushesBefore(bytes, b, capBytes)) {
        out[g].push_back(makeBucket(c, cur));
        cur.clear();
        bytes = 0;
      }
      cur.push_back(p);
      bytes += b;
    }
    if (!cur.empty()) out[g].push_back(makeBucket(c, cur));
  }
  return out;
}

BucketSet optimalBuckets(const Context& c, uint64_t capBytes) {
  // Longest run of gradients one bucket may hold; bounds the DP at O(n * window).
  constexpr size_t kMaxWindow = 512;
  BucketSet out(c.w.graphs.size());
  for (size_t g = 0; g < c.w.graphs.size(); ++g) {
    auto grads = gradients(c.w, static_cast<int32_t>(g));
    size_t n = grads.size();
    if (n == 0) continue;
    const std::vector<double>& t = c.views[g].issueUs;
    std::vector<uint64_t> prefix(n + 1, 0);
    for (size_t i = 0; i < n; ++i) {
      prefix[i + 1] = prefix[i] + c.w.params[static_cast<size_t>(grads[i].second)].gradBytes;
    }
    struct State {
      double end = 0, busy = 0;
      int64_t count = 0;
      size_t from = 0;
    };
    auto better = [](const State& a, const State& b) {
      // Times within a nanosecond are equal: keeps ties deterministic across
      // summation orders.
      if (a.end < b.end - 1e-3) return true;
      if (a.end > b.end + 1e-3) return false;
      if (a.busy < b.busy - 1e-3) return true;
      if (a.busy > b.busy + 1e-3) return false;
      return a.count < b.count;
    };
    std::vector<State> best(n + 1);
    for (size_t i = 1; i <= n; ++i) {
      double ready = t[static_cast<size_t>(grads[i - 1].first)];
      bool have = false;
      for (size_t k = i; k-- > 0 && i - k <= kMaxWindow;) {
        uint64_t bytes = prefix[i] - prefix[k];
        if (bytes > capBytes && k < i - 1) break;
        double dur = c.cost.us(c.reduceOp, bytes);
        State s{std::max(ready, best[k].end) + dur, best[k].busy + dur, best[k].count + 1, k};
        if (!have || better(s, best[i])) {
          best[i] = s;
          have = true;
        }
      }
    }
    std::vector<std::pair<size_t, size_t>> ranges;
    for (size_t i = n; i > 0; i = best[i].from) ranges.emplace_back(best[i].from, i);
    std::reverse(ranges.begin(), ranges.end());
    for (const auto& [a, b] : ranges) {
      std::vector<int32_t> params;
      for (size_t k = a; k < b; ++k) params.push_back(grads[k].second);
      out[g].push_back(makeBucket(c, params));
    }
  }
  return out;
}

std::vector<BucketTiming> bucketTimings(const Context& c, int32_t graph,
                                        const std::vector<schemas::PlanBucket>& buckets) {
  const WorkGraph& wg = c.w.graphs[static_cast<size_t>(graph)];
  const std::vector<double>& t = c.views[static_cast<size_t>(graph)].issueUs;
  std::vector<int32_t> bucketOf(c.w.params.size(), -1);
  for (size_t b = 0; b < buckets.size(); ++b) {
    for (int64_t id : buckets[b].dsIds) {
      int32_t p = c.w.paramIndex(id);
      if (p >= 0) bucketOf[static_cast<size_t>(p)] = static_cast<int32_t>(b);
    }
  }
  std::vector<BucketTiming> out(buckets.size());
  std::vector<char> started(buckets.size(), 0);
  for (size_t i = 0; i < wg.ops.size(); ++i) {
    const WorkOp& op = wg.ops[i];
    if (op.role != OpRole::ReduceGrad) continue;
    int32_t b = bucketOf[static_cast<size_t>(op.param)];
    if (b < 0) continue;
    BucketTiming& bt = out[static_cast<size_t>(b)];
    if (!started[static_cast<size_t>(b)]) {
      started[static_cast<size_t>(b)] = 1;
      bt.firstSeq = op.seq;
      bt.firstOp = static_cast<int32_t>(i);
    }
    bt.lastSeq = op.seq;
    bt.lastOp = static_cast<int32_t>(i);
    bt.readyUs = t[i];
  }
  double free = 0;
  for (size_t b = 0; b < buckets.size(); ++b) {
    out[b].startUs = std::max(out[b].readyUs, free);
    out[b].endUs = out[b].startUs + c.cost.us(c.reduceOp, buckets[b].bytes);
    free = out[b].endUs;
  }
  return out;
}

// ---- gathers -----------------------------------------------------------------

std::vector<std::vector<GatherUse>> gatherUses(const Context& c, const std::vector<char>& persistent) {
  const Workload& w = c.w;
  std::vector<std::vector<GatherUse>> out(w.graphs.size());
  std::vector<char> allocated(w.params.size(), 0);
  std::vector<int32_t> lastRelease(w.params.size(), -1);
  std::vector<int32_t> releaseStamp(w.params.size(), -1);
  for (size_t r = 0; r < w.runs.size(); ++r) {
    const GraphRun& run = w.runs[r];
    const WorkGraph& g = w.graphs[static_cast<size_t>(run.graph)];
    const GraphView& v = c.views[static_cast<size_t>(run.graph)];
    bool recording = v.run == static_cast<int32_t>(r);
    int32_t n = static_cast<int32_t>(g.ops.size());
    for (int32_t i = 0; i < n; ++i) {
      const WorkOp& op = g.ops[static_cast<size_t>(i)];
      size_t p = static_cast<size_t>(op.param);
      if (op.role == OpRole::Release) {
        if (!persistent[p]) allocated[p] = 0;
        lastRelease[p] = i;
        releaseStamp[p] = static_cast<int32_t>(r);
      }
      if (op.role != OpRole::Gather || allocated[p]) continue;
      allocated[p] = 1;
      if (!recording) continue;
      GatherUse u;
      u.param = op.param;
      u.gatherOp = i;
      u.waitOp = i;
      for (int32_t k = i; k < n; ++k) {
        const WorkOp& o = g.ops[static_cast<size_t>(k)];
        if (o.param == op.param && o.role == OpRole::GatherWait) {
          u.waitOp = k;
          break;
        }
      }
      u.releaseOp = n;
      if (!persistent[p]) {
        for (int32_t k = u.waitOp; k < n; ++k) {
          const WorkOp& o = g.ops[static_cast<size_t>(k)];
          if (o.param == op.param && o.role == OpRole::Release) {
            u.releaseOp = k;
            break;
          }
        }
      }
      u.minOp = releaseStamp[p] == static_cast<int32_t>(r) ? lastRelease[p] + 1 : 0;
      u.needUs = v.issueUs[static_cast<size_t>(u.waitOp)];
      u.bytes = w.params[p].gatherBytes;
      u.durUs = c.cost.us(Collective::AllGather, u.bytes);
      out[static_cast<size_t>(run.graph)].push_back(u);
    }
  }
  return out;
}

const char* issueReasonText(IssueReason r) {
  switch (r) {
    case IssueReason::OnDemand:
      return "on use: an earlier issue would exceed the memory limit";
    case IssueReason::JustInTime:
      return "just in time: finishes before its first user";
    case IssueReason::GraphStart:
      return "graph start: communication-bound, as early as the graph allows";
    case IssueReason::AfterRelease:
      return "after the release of its previous use";
    case IssueReason::IssueOrder:
      return "behind the gather before it on the stream";
    case IssueReason::MemoryLimited:
      return "memory-limited: earlier would exceed the memory limit";
    case IssueReason::Fused:
      return "fused: joins the group before it to save a call's latency";
  }
  return "?";
}

namespace {

/// The memory curve of every graph when every gather happens on use (per op, the most of any of
/// its runs, during the compute before the op and at it): what prefetching adds to. It is the
/// simulator's own curve, so the prefetch pass and the final check use one memory model.
std::vector<std::vector<uint64_t>> onUseMemory(const Context& c, const std::vector<char>& persistent,
                                               const BucketSet& buckets) {
  const Workload& w = c.w;
  std::vector<std::vector<schemas::PrefetchGroup>> none(w.graphs.size());
  SimOptions record;
  record.record = true;
  const SimResult sim =
      simulate(w, c.cost, compileSchedule(w, assemble(c, persistent, buckets, none)), record);
  std::vector<std::vector<uint64_t>> m(w.graphs.size());
  for (size_t g = 0; g < w.graphs.size(); ++g) m[g].assign(w.graphs[g].ops.size(), 0);
  for (const MemorySample& s : sim.memory) {
    if (s.run < 0 || s.seq < 0) continue;
    const size_t g = static_cast<size_t>(w.runs[static_cast<size_t>(s.run)].graph);
    const std::vector<WorkOp>& ops = w.graphs[g].ops;
    auto it = std::lower_bound(ops.begin(), ops.end(), s.seq,
                               [](const WorkOp& op, int64_t seq) { return op.seq < seq; });
    if (it == ops.end() || it->seq != s.seq) continue;
    uint64_t& most = m[g][static_cast<size_t>(it - ops.begin())];
    most = std::max(most, s.bytes);
  }
  return m;
}

/// One graph's gathers as the prefetch pass places them: the memory curve it adds to, and each
/// gather's issue op and reason.
struct GraphPrefetch {
  const Context& c;
  const std::vector<char>& persistent;
  const std::vector<GatherUse>& us;
  const std::vector<double>& t;  ///< host issue time of each op
  std::vector<uint64_t> mem;     ///< memory at each op with the gathers placed so far
  uint64_t limit;
  std::vector<int32_t> issue;
  std::vector<IssueReason> reason;

  /// What an earlier issue holds longer: the copy and the call's scratch kept until the wait
  /// (as a fused call's, the larger).
  uint64_t memBytes(const GatherUse& u) const {
    const WorkParam& p = c.w.params[static_cast<size_t>(u.param)];
    if (persistent[static_cast<size_t>(u.param)]) return 0;
    return p.mem.gathered + c.w.memory.gatherScratchUntilWait(u.bytes, /*coalesced=*/true);
  }

  bool memFits(int32_t from, int32_t to, uint64_t b) const {
    for (int32_t i = from; i < to; ++i) {
      if (mem[static_cast<size_t>(i)] + b > limit) return false;
    }
    return true;
  }

  void hold(int32_t from, int32_t to, uint64_t b) {
    for (int32_t i = from; i < to; ++i) mem[static_cast<size_t>(i)] += b;
  }

  /// 1. As late as still finishes in time, on one stream in issue order.
  std::vector<int32_t> justInTime() {
    const size_t m = us.size();
    std::vector<int32_t> target(m);
    reason.assign(m, IssueReason::JustInTime);
    double latest = std::numeric_limits<double>::infinity();
    for (size_t j = m; j-- > 0;) {
      double end = std::min(us[j].needUs, latest);
      double start = end - us[j].durUs;
      latest = start;
      auto upto = t.begin() + us[j].gatherOp + 1;
      auto it = std::upper_bound(t.begin(), upto, start);
      if (it == t.begin()) {
        target[j] = 0;
        reason[j] = IssueReason::GraphStart;
      } else {
        target[j] = static_cast<int32_t>(it - t.begin()) - 1;
      }
      if (target[j] < us[j].minOp) {
        target[j] = us[j].minOp;
        reason[j] = IssueReason::AfterRelease;
      }
    }
    return target;
  }

  /// 2. No earlier than the gather before it; later while memory would pass the limit.
  void underLimit(const std::vector<int32_t>& target) {
    issue.assign(us.size(), 0);
    int32_t prev = 0;
    for (size_t j = 0; j < us.size(); ++j) {
      int32_t want = std::max(target[j], prev);
      if (want > target[j]) reason[j] = IssueReason::IssueOrder;
      uint64_t b = memBytes(us[j]);
      int32_t q = us[j].gatherOp;
      while (q > want && mem[static_cast<size_t>(q - 1)] + b <= limit) --q;
      if (q > want) reason[j] = q == us[j].gatherOp ? IssueReason::OnDemand : IssueReason::MemoryLimited;
      hold(q, us[j].gatherOp, b);
      issue[j] = q;
      prev = q;
    }
  }

  struct Group {
    int32_t op;
    std::vector<size_t> members;
    uint64_t bytes;
    double start;
    double minNeed;
  };

  /// Whether gather j joins group `cur` (moved up to its op where it is issued later): where the
  /// fused call makes nothing later than separate calls would.
  bool joins(Group& cur, size_t j, uint64_t maxFusedBytes) {
    const GatherUse& u = us[j];
    const CostModel& cost = c.cost;
    bool samePos = issue[j] == cur.op;
    bool small = cost.latencyUs(Collective::AllGather) >= 0.5 * u.durUs;
    bool canMove = !samePos && small && cur.op >= u.minOp && memFits(cur.op, issue[j], memBytes(u));
    if (!(samePos || canMove) || cur.bytes + u.bytes > maxFusedBytes) return false;
    double endGroup = cur.start + cost.us(Collective::AllGather, cur.bytes);
    double sepEnd = std::max(t[static_cast<size_t>(issue[j])], endGroup) + u.durUs;
    double lateSep = std::max(endGroup - cur.minNeed, sepEnd - u.needUs);
    double fusedEnd = cur.start + cost.us(Collective::AllGather, cur.bytes + u.bytes);
    double lateFused = std::max(fusedEnd - cur.minNeed, fusedEnd - u.needUs);
    if (std::max(0.0, lateFused) > std::max(0.0, lateSep) + 1e-6) return false;
    if (canMove) {
      hold(cur.op, issue[j], memBytes(u));
      issue[j] = cur.op;
      reason[j] = IssueReason::Fused;
    }
    cur.members.push_back(j);
    cur.bytes += u.bytes;
    cur.minNeed = std::min(cur.minNeed, u.needUs);
    return true;
  }

  /// 3. Groups: one call per gather, or fused where no member ends later.
  std::vector<Group> groups(FuseMode mode, uint64_t maxFusedBytes) {
    std::vector<Group> out;
    double free = 0;
    for (size_t j = 0; j < us.size(); ++j) {
      if (mode == FuseMode::Fuse && !out.empty() && joins(out.back(), j, maxFusedBytes)) continue;
      if (!out.empty()) free = out.back().start + c.cost.us(Collective::AllGather, out.back().bytes);
      out.push_back(
          Group{issue[j], {j}, us[j].bytes, std::max(t[static_cast<size_t>(issue[j])], free), us[j].needUs});
    }
    return out;
  }
};

}  // namespace

PrefetchResult planPrefetch(const Context& c, const std::vector<char>& persistent, const BucketSet& buckets,
                            uint64_t limit, FuseMode mode, uint64_t maxFusedBytes) {
  const Workload& w = c.w;
  PrefetchResult res;
  res.groups.resize(w.graphs.size());
  const auto uses = gatherUses(c, persistent);
  const std::vector<std::vector<uint64_t>> onUse = onUseMemory(c, persistent, buckets);
  for (size_t g = 0; g < w.graphs.size(); ++g) {
    const std::vector<GatherUse>& us = uses[g];
    if (us.empty()) continue;
    const std::vector<double>& t = c.views[g].issueUs;
    GraphPrefetch gp{c, persistent, us, t, onUse[g], limit, {}, {}};
    gp.underLimit(gp.justInTime());
    // A group issued before its first member's own gather, or of several members, is planned;
    // a gather on use is the runtime's default.
    for (const GraphPrefetch::Group& grp : gp.groups(mode, maxFusedBytes)) {
      const bool early = grp.op < us[grp.members.front()].gatherOp;
      int32_t index = -1;
      if (early || grp.members.size() > 1) {
        schemas::PrefetchGroup pg;
        pg.position = w.graphs[g].ops[static_cast<size_t>(grp.op)].seq;
        for (size_t j : grp.members) pg.dsIds.push_back(w.params[static_cast<size_t>(us[j].param)].id);
        index = static_cast<int32_t>(res.groups[g].size());
        res.groups[g].push_back(std::move(pg));
      }
      for (size_t j : grp.members) {
        res.decisions.push_back(IssueDecision{static_cast<int32_t>(g), static_cast<int32_t>(j), grp.op, index,
                                              gp.reason[j], us[j].needUs - t[static_cast<size_t>(grp.op)]});
      }
    }
  }
  return res;
}

PrefetchResult referencePrefetch(const Context& c, const std::vector<char>& persistent,
                                 uint64_t maxInFlightBytes) {
  const Workload& w = c.w;
  PrefetchResult res;
  res.groups.resize(w.graphs.size());
  auto uses = gatherUses(c, persistent);
  for (size_t g = 0; g < w.graphs.size(); ++g) {
    const std::vector<GatherUse>& us = uses[g];
    const WorkGraph& wg = w.graphs[g];
    const std::vector<double>& t = c.views[g].issueUs;
    size_t f = static_cast<size_t>(kReferencePrefetchFactor);
    int32_t lastOp = 0;
    for (size_t first = 0; first < us.size(); first += f) {
      size_t last = std::min(us.size(), first + f);
      uint64_t bytes = 0;
      int32_t minOp = 0;
      for (size_t j = first; j < last; ++j) {
        bytes += us[j].bytes;
        minOp = std::max(minOp, us[j].minOp);
      }
      int32_t op = first == 0 ? us[first].gatherOp : us[first - f].gatherOp;
      // Plans list groups in position order; a clamp may not reorder them.
      op = std::max({op, minOp, lastOp});
      bool grouped = bytes <= maxInFlightBytes;
      int32_t index = -1;
      if (grouped && (op < us[first].gatherOp || last - first > 1)) {
        schemas::PrefetchGroup pg;
        pg.position = wg.ops[static_cast<size_t>(op)].seq;
        for (size_t j = first; j < last; ++j)
          pg.dsIds.push_back(w.params[static_cast<size_t>(us[j].param)].id);
        index = static_cast<int32_t>(res.groups[g].size());
        res.groups[g].push_back(std::move(pg));
        lastOp = op;
      }
      for (size_t j = first; j < last; ++j) {
        int32_t at = index >= 0 ? op : us[j].gatherOp;
        res.decisions.push_back(IssueDecision{static_cast<int32_t>(g), static_cast<int32_t>(j), at, index,
                                              index >= 0 ? IssueReason::Fused : IssueReason::OnDemand,
                                              us[j].needUs - t[static_cast<size_t>(at)]});
      }
    }
  }
  return res;
}

// ---- persistence ---------------------------------------------------------------

PersistChoice knapsackPersistence(const Context& c, uint64_t capBytes, const std::vector<double>* stallUs,
                                  double streamWeight, bool onlyStalled) {
  const Workload& w = c.w;
  PersistChoice out;
  out.persistent.assign(w.params.size(), 0);
  if (capBytes == 0) return out;
  std::vector<int32_t> count = gathersPerStep(w);
  struct Item {
    size_t param;
    uint64_t bytes;
    double value;
  };
  std::vector<Item> items;
  for (size_t p = 0; p < w.params.size(); ++p) {
    uint64_t b = w.params[p].gatherBytes;
    if (count[p] < 2 || b == 0 || b > capBytes) continue;
    // Valued by stalls, a parameter that never stalls is not worth its memory.
    if (onlyStalled && stallUs && (*stallUs)[p] <= 0) continue;
    double saved = (count[p] - 1) * c.cost.us(Collective::AllGather, b);
    double value = streamWeight * saved + (stallUs ? (*stallUs)[p] : 0.0);
    if (value <= 0) continue;
    items.push_back({p, b, value});
  }
  if (items.empty()) return out;
  auto take = [&](const Item& it) {
    out.persistent[it.param] = 1;
    out.bytes += it.bytes;
    out.savedUs += (count[it.param] - 1) * c.cost.us(Collective::AllGather, it.bytes);
  };
  uint64_t total = 0;
  for (const Item& it : items) total += it.bytes;
  if (total <= capBytes) {  // everything fits: nothing to choose (the table's rounding could drop some)
    for (const Item& it : items) take(it);
    return out;
  }
  // Capacity in units so the table stays small; weights round up, so the
  // choice never exceeds the capacity.
  constexpr uint64_t kUnits = 2048;
  uint64_t unit = std::max<uint64_t>(1, (capBytes + kUnits - 1) / kUnits);
  size_t cap = static_cast<size_t>(capBytes / unit);
  std::vector<double> best(cap + 1, 0.0);
  std::vector<std::vector<char>> chosen(items.size(), std::vector<char>(cap + 1, 0));
  for (size_t k = 0; k < items.size(); ++k) {
    size_t wu = static_cast<size_t>((items[k].bytes + unit - 1) / unit);
    if (wu > cap) continue;
    for (size_t x = cap; x >= wu; --x) {
      double v = best[x - wu] + items[k].value;
      if (v > best[x] + 1e-9) {
        best[x] = v;
        chosen[k][x] = 1;
      }
      if (x == wu) break;
    }
  }
  size_t x = cap;
  for (size_t k = items.size(); k-- > 0;) {
    if (!chosen[k][x]) continue;
    take(items[k]);
    x -= static_cast<size_t>((items[k].bytes + unit - 1) / unit);
  }
  return out;
}

PersistChoice referencePersistence(const Context& c, uint64_t capBytes) {
  const Workload& w = c.w;
  PersistChoice out;
  out.persistent.assign(w.params.size(), 0);
  std::vector<int32_t> count = gathersPerStep(w);
  std::vector<size_t> order;
  for (size_t p = 0; p < w.params.size(); ++p) {
    if (count[p] > 0 && w.params[p].gatherBytes > 0) order.push_back(p);
  }
  auto perByte = [&](size_t p) {
    return c.cost.us(Collective::AllGather, w.params[p].gatherBytes) /
           static_cast<double>(w.params[p].gatherBytes);
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return perByte(a) > perByte(b); });
  for (size_t p : order) {
    uint64_t b = w.params[p].gatherBytes;
    if (out.bytes + b > capBytes) break;  // the reference stops at the first misfit
    out.persistent[p] = 1;
    out.bytes += b;
    out.savedUs += (count[p] - 1) * c.cost.us(Collective::AllGather, b);
  }
  return out;
}

// ---- assembly ---------------------------------------------------------------------

Schedule assemble(const Context& c, const std::vector<char>& persistent, const BucketSet& buckets,
                  const std::vector<std::vector<schemas::PrefetchGroup>>& groups) {
  Schedule s;
  for (size_t p = 0; p < c.w.params.size(); ++p) {
    if (persistent[p]) s.persistent.push_back(c.w.params[p].id);
  }
  std::sort(s.persistent.begin(), s.persistent.end());
  for (size_t g = 0; g < c.w.graphs.size(); ++g) {
    schemas::PlanGraph pg;
    pg.id = c.w.graphs[g].id;
    pg.kind = c.w.graphs[g].kind;
    pg.inputShapes = c.w.graphs[g].inputShapes;
    if (g < groups.size()) pg.prefetch = groups[g];
    if (g < buckets.size()) pg.buckets = buckets[g];
    if (g < c.offloadSaves.size()) pg.offloadSaves = c.offloadSaves[g];
    pg.persistentEnds = persistentEnds(c.w, c.w.graphs[g], persistent);
    s.graphs.push_back(std::move(pg));
  }
  s.optimizerOffload = c.offload;
  return s;
}

}  // namespace dcplan::planner::detail
