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

  /// Whether a gathered parameter stays gathered when its last user releases it.
  virtual bool keepGathered(int64_t dsId, bool registeredPersistent, bool stageKeepsAll) {
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
};

}  // namespace dcplan::replayer
