// The one place where scheduling decisions are made: prefetch, persistence, bucket flush.
#pragma once

#include "dcplan/replayer/OpObserver.h"

#include <cstdint>
#include <vector>

namespace dcplan::replayer {

/// Decides what the executor does beyond the op it is running. The default
/// schedule gathers on use, keeps only registered-persistent parameters and
/// flushes a reduce bucket when it would exceed the configured byte size. A
/// plan cursor (replay of a plan) implements the same interface.
class SchedulePolicy {
 public:
  virtual ~SchedulePolicy() = default;

  /// Called before every op of a graph; returns the ids to prefetch, as one
  /// fused gather, before the op runs (ids already gathered are skipped).
  virtual std::vector<int64_t> prefetchBefore(const OpEvent& event) { return {}; }

  /// Whether a gathered parameter stays gathered when its last user releases it; trainable: an
  /// optimizer step may change its shard.
  virtual bool keepGathered(int64_t dsId, bool registeredPersistent, bool stageKeepsAll, bool trainable) {
    return registeredPersistent || stageKeepsAll;
  }

  /// Whether the reduce bucket holding pendingBytes must be flushed before a
  /// gradient of nextBytes is added. All sizes in bytes.
  virtual bool flushBefore(int64_t graphId, int64_t pendingBytes, int64_t nextBytes, int64_t bucketBytes) {
    return pendingBytes > 0 && pendingBytes + nextBytes > bucketBytes;
  }

  /// A graph starts / ends (start_forward, start_backward, end_*).
  virtual void onGraphStart(int64_t graphId) {}
  virtual void onGraphEnd(int64_t graphId) {}

  // ---- replay of a plan (PlanCursor); every default keeps the behaviour above.

  /// Gathers the executor launches before an op, one fused gather each;
  /// Undefined dtype: the shard's dtype.
  struct Prefetch {
    std::vector<int64_t> dsIds;
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    int64_t peakBytes = -1;  ///< the plan's peak_bytes (-1: not given), for the budget guard
  };
  /// Called before every op a hook issues for a registered graph, in issue
  /// order (the executor's own prefetches are not ops). May throw c10::Error
  /// to stop at a departure from a plan.
  virtual std::vector<Prefetch> beforeOp(const OpEvent& event) { return {}; }
  /// A gather collective was launched for dsIds (bytes received); planned:
  /// by beforeOp rather than by the op itself.
  virtual void onGatherLaunched(int64_t graphId, const std::vector<int64_t>& dsIds, int64_t bytes,
                                bool planned) {}
  /// What the budget guard held back: a group beforeOp returned ("prefetch", reported instead of
  /// onGatherLaunched) or a copy the plan keeps, dropped at its release ("keep"); the ids not
  /// gathered or not kept, their bytes, the plan's peak for it, the agreed excess and the budget.
  struct GuardHold {
    const char* kind = "prefetch";
    std::vector<int64_t> held;
    int64_t bytes = 0;
    int64_t peakBytes = 0;
    int64_t excessBytes = 0;
    int64_t budgetBytes = 0;
  };
  virtual void onGuardHold(int64_t graphId, const GuardHold& hold) {}
  /// The plan's peak for keeping dsId gathered at its release (its persistent_peak_bytes), for
  /// the budget guard; -1 where the plan does not keep it or gives none.
  virtual int64_t keptPeak(int64_t dsId) { return -1; }
  /// Whether the bucket must be flushed right after the gradient of dsId went in.
  virtual bool flushAfter(int64_t graphId, int64_t dsId) { return false; }
  /// The planned bucket the gradient of dsId goes into (its ds_ids), so that a flat bucket is
  /// allocated at its planned size; nullptr without one (the configured size then).
  virtual const std::vector<int64_t>* plannedBucket(int64_t graphId, int64_t dsId) { return nullptr; }
  /// A bucket's reduction is launched: its gradients in bucket order and its bytes.
  virtual void onFlush(int64_t graphId, const std::vector<int64_t>& dsIds, int64_t bytes) {}
  /// start_forward() / start_backward() was called.
  virtual void onStartForward() {}
  virtual void onStartBackward(bool update, bool sync) {}
};

}  // namespace dcplan::replayer
