// Private: the planning passes shared by the strategies (views, buckets, prefetch, persistence).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dcplan/planner/cost_model.h"
#include "dcplan/planner/simulator.h"
#include "dcplan/planner/workload.h"

namespace dcplan::planner::detail {

/// A graph as the planner reasons about it: its first run, with stall-free times.
struct GraphView {
  int32_t graph = 0;
  int32_t run = 0;              ///< first run of the graph in the step
  std::vector<double> issueUs;  ///< stall-free time at which op i is issued
};

struct Context {
  const Workload& w;
  const CostModel& cost;
  uint64_t limit;  ///< memory limit the plan must respect
  std::vector<GraphView> views;
  Collective reduceOp;
  /// Optimizer state kept on the host (planned offload): every schedule assembled carries it.
  std::vector<schemas::OffloadGroup> offload;
  /// Saved activations kept on the host (planned activation offload), by Workload graph index:
  /// every schedule assembled carries them.
  std::vector<std::vector<schemas::OffloadedSave>> offloadSaves;
  int32_t runOfGraph(int32_t g) const { return views[static_cast<size_t>(g)].run; }
};

Context makeContext(const Workload& w, const CostModel& cost, uint64_t limit);

// ---- buckets -------------------------------------------------------------

/// Buckets per graph (empty for graphs without gradients), in Workload graph order.
using BucketSet = std::vector<std::vector<schemas::PlanBucket>>;

/// Fills buckets in gradient-ready order and closes one when the next gradient
/// would take it past `capBytes` (the runtime's default behaviour).
BucketSet greedyBuckets(const Context& c, uint64_t capBytes);

/// Boundaries minimising when the last reduction of each backward ends (ties:
/// less reduce-stream time, then fewer buckets), with no bucket above `capBytes`
/// unless a single gradient is larger.
BucketSet optimalBuckets(const Context& c, uint64_t capBytes);

/// Timing of one bucket under the stall-free model, for explanations.
struct BucketTiming {
  int64_t firstSeq = 0, lastSeq = 0;
  int32_t firstOp = 0, lastOp = 0;  ///< the same, as indices into the graph's ops
  double readyUs = 0, startUs = 0, endUs = 0;
};
std::vector<BucketTiming> bucketTimings(const Context& c, int32_t graph,
                                        const std::vector<schemas::PlanBucket>& buckets);

// ---- gathers ------------------------------------------------------------

/// One gather the graph's first run performs when nothing is prefetched.
struct GatherUse {
  int32_t param = 0;
  int32_t gatherOp = 0;   ///< the allgather_param op
  int32_t waitOp = 0;     ///< its first user
  int32_t releaseOp = 0;  ///< where it is freed (ops.size() when never)
  int32_t minOp = 0;      ///< earliest legal issue: after the previous release of the param
  double needUs = 0;      ///< stall-free time of the first user
  double durUs = 0;
  uint64_t bytes = 0;
};

/// The gathers of each graph's first run given a persistent set (persistent
/// parameters gather once per step; later uses find them resident).
std::vector<std::vector<GatherUse>> gatherUses(const Context& c, const std::vector<char>& persistent);

enum class IssueReason {
  OnDemand,       ///< no earlier issue fits the memory limit
  JustInTime,     ///< early enough to finish before its first user
  GraphStart,     ///< communication-bound: as early as the graph allows
  AfterRelease,   ///< no earlier than the release of the parameter's previous use
  IssueOrder,     ///< behind the gather before it on the stream
  MemoryLimited,  ///< earlier would exceed the memory limit
  Fused,          ///< moved into a neighbouring fused group
};
const char* issueReasonText(IssueReason r);

struct IssueDecision {
  int32_t graph = 0;
  int32_t use = 0;
  int32_t issueOp = 0;
  int32_t group = -1;  ///< index into the graph's prefetch groups, -1: natural gather
  IssueReason reason = IssueReason::OnDemand;
  double leadUs = 0;  ///< stall-free time from issue to first user
};

enum class FuseMode { Split, Fuse };

struct PrefetchResult {
  std::vector<std::vector<schemas::PrefetchGroup>> groups;  ///< per Workload graph
  std::vector<IssueDecision> decisions;
};

/// Issues every gather as late as still finishes before its first user on an
/// all-gather stream shared in order (as early as possible when communication
/// bound), then moves it later while the memory curve would pass `limit`, then
/// (FuseMode::Fuse) fuses neighbouring gathers when that does not make any of
/// them later and the fused call stays under `maxFusedBytes`.
PrefetchResult planPrefetch(const Context& c, const std::vector<char>& persistent, const BucketSet& buckets,
                            uint64_t limit, FuseMode mode, uint64_t maxFusedBytes);

/// The reference's rule: groups of kReferencePrefetchFactor gathers, each launched
/// at the first gather of the group before it, unless the group is larger than
/// `maxInFlightBytes`.
PrefetchResult referencePrefetch(const Context& c, const std::vector<char>& persistent,
                                 uint64_t maxInFlightBytes);

// ---- persistence ------------------------------------------------------------

struct PersistChoice {
  std::vector<char> persistent;  ///< by param index
  uint64_t bytes = 0;
  double savedUs = 0;  ///< all-gather time saved per step
};

/// 0/1 knapsack against gathered bytes, capacity `capBytes`. Value of a
/// parameter: `stallUs[p]` (compute stalled on its repeated gathers in a
/// simulation) when given (with `onlyStalled`, only parameters that stalled take part), plus the
/// all-gather stream time it saves per step (gathers per optimizer step minus
/// one, times the gather time) scaled by `streamWeight`, which breaks ties
/// towards freeing the stream.
PersistChoice knapsackPersistence(const Context& c, uint64_t capBytes,
                                  const std::vector<double>* stallUs = nullptr, double streamWeight = 1.0,
                                  bool onlyStalled = false);

/// The reference's rule: by gather time per byte, descending, stopping at the
/// first parameter that does not fit in `capBytes`.
PersistChoice referencePersistence(const Context& c, uint64_t capBytes);

// ---- assembly --------------------------------------------------------------

Schedule assemble(const Context& c, const std::vector<char>& persistent, const BucketSet& buckets,
                  const std::vector<std::vector<schemas::PrefetchGroup>>& groups);

}  // namespace dcplan::planner::detail
