// What a recorded run's runtime held besides activations (see recorded_holdings.h).
#include "recorded_holdings.h"

#include <algorithm>
#include <optional>

namespace dcplan::planner::detail {

RecordedHoldings::RecordedHoldings(const Workload& w, const schemas::Trace& trace)
    : stage_(w.stage), memory_(RuntimeMemory::of(trace.meta, w.traceWorldSize)) {
  for (const schemas::TraceParam& p : trace.params) sizes_[p.id] = memory_.param(p.numel);
  // ZeRO-1's flat bucket buffer: the configured size, in the reduce dtype's [world, cols] layout.
  const uint64_t ranks = static_cast<uint64_t>(w.traceWorldSize);
  const uint64_t cols = std::max<uint64_t>(1, kDefaultBucketBytes / (memory_.reduceSize * ranks));
  flatBufferBytes_ = memory_.allocation(cols * memory_.reduceSize * ranks);
}

void RecordedHoldings::after(const schemas::OpEvent& e, bool sync) {
  const std::optional<OpRole> role = schemas::opRole(e.op);
  if (role == OpRole::Gather || role == OpRole::Prefetch) {
    // The call gathers the members not held already; one of them alone holds nothing more.
    std::vector<int64_t> called;
    uint64_t callBytes = 0;
    for (int64_t id : e.dsIds) {
      if (gathered_.count(id)) continue;
      const uint64_t b = sizes_.at(id).gathered;
      gathered_[id] = b;
      gatheredBytes_ += b;
      called.push_back(id);
      callBytes += b;
    }
    const uint64_t buffer = called.size() > 1 ? memory_.gatherScratchUntilWait(callBytes, true) : 0;
    if (buffer > 0) {
      calls_.emplace_back(std::move(called), buffer);
      callBuffers_ += buffer;
    }
  } else if (role == OpRole::GatherWait && !e.dsIds.empty()) {
    for (auto it = calls_.begin(); it != calls_.end();) {
      const std::vector<int64_t>& members = it->first;
      if (std::find(members.begin(), members.end(), e.dsIds[0]) == members.end()) {
        ++it;
        continue;
      }
      callBuffers_ -= it->second;
      it = calls_.erase(it);
    }
  } else if (role == OpRole::Release && !e.dsIds.empty() && stage_ == 3) {
    // (ZeRO-1/2 keep every gathered copy until the optimizer step.)
    auto it = gathered_.find(e.dsIds[0]);
    if (it != gathered_.end()) {
      gatheredBytes_ -= it->second;
      gathered_.erase(it);
    }
  } else if (defers(e)) {
    if (flushesBefore(filling_, e.bytes, kDefaultBucketBytes)) {
      // Launched here: packed (its gradients freed) and held with its output until the next
      // launch (at one rank the packed bucket is the output); the one before is freed here. (The
      // reduce-scatter's own scratch is not taken out: the recorded run may have freed it
      // already; the simulator counts the plan's.)
      held_ = memory_.packedInput(filling_) + launch();
      filling_ = 0;
      deferred_ = 0;
    }
    filling_ += e.bytes;
    deferred_ += sizes_.at(e.dsIds[0]).gradient;
    members_.push_back(e.dsIds[0]);
  } else if (stage_ < 2 && sync && role == OpRole::ReduceGrad && e.bytes > 0 && !e.dsIds.empty()) {
    // ZeRO-1 copies the gradient into a flat buffer of the configured size, allocated at the
    // first gradient of each of its two buffers and kept until end_backward.
    if (flushesBefore(filling_, e.bytes, kDefaultBucketBytes)) {
      launch();
      filling_ = 0;
      current_ = 1 - current_;
    }
    if (!allocated_[current_]) {
      allocated_[current_] = true;
      flat_ += flatBufferBytes_;
    }
    filling_ += e.bytes;
    members_.push_back(e.dsIds[0]);
  } else if (role == OpRole::EndBackward) {
    launch();  // the last bucket: flushed, drained and freed, its gradient shards made
    filling_ = held_ = deferred_ = flat_ = 0;
    allocated_[0] = allocated_[1] = false;
  }
}

uint64_t RecordedHoldings::launch() {
  uint64_t held = 0;
  for (int64_t id : members_) {
    const ReducedMemory left = memory_.reduced(sizes_.at(id), !hasShardGrad_[id]);
    hasShardGrad_[id] = 1;
    held += left.held;
    shardGrads_ += left.kept;
  }
  members_.clear();
  return held;
}

}  // namespace dcplan::planner::detail
