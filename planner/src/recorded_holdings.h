// What a recorded run's runtime held besides activations, op by op.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dcplan/planner/runtime_memory.h"
#include "dcplan/planner/workload.h"
#include "dcplan/schemas/trace.h"

namespace dcplan::planner::detail {

/// What the recorded run's runtime held besides activations, op by op: gathered copies, fused
/// gather calls' buffers, gradients waiting in a bucket, launched buckets and gradient shards. A
/// trace is recorded without a plan: gather on use (a module's parameters in one fused call) and
/// the default buckets, flushed when the next gradient would take one past kDefaultBucketBytes. Its activations are its recorded memory less these (the simulator adds
/// the plan's own). Sizes are the recorded run's: its world size, its transport's allocator.
class RecordedHoldings {
 public:
  RecordedHoldings(const Workload& w, const schemas::Trace& trace);

  /// Bytes held (besides baseline and activations) before the next op.
  uint64_t heldBytes() const { return gatheredBytes_ + callBuffers_ + held_ + deferred_ + shardGrads_ + flat_; }

  /// ZeRO-2/3: the gradient a reduce_grad hands over (in its memory_bytes already).
  uint64_t arrivingBytes(const schemas::OpEvent& e) const {
    return defers(e) ? sizes_.at(e.dsIds[0]).gradient : 0;
  }

  /// Updates what is held after op e of a micro-step (sync: the one the optimizer step follows).
  void after(const schemas::OpEvent& e, bool sync);

 private:
  bool defers(const schemas::OpEvent& e) const {
    return stage_ >= 2 && schemas::opRole(e.op) == OpRole::ReduceGrad && e.bytes > 0 && !e.dsIds.empty();
  }

  /// The bucket's gradients are reduced (RuntimeMemory::reduced): returns what is held with it
  /// until the next launch; the shards' new gradients stay.
  uint64_t launch();

  int64_t stage_;
  RuntimeMemory memory_;
  std::unordered_map<int64_t, ParamMemory> sizes_;
  std::unordered_map<int64_t, uint64_t> gathered_;
  uint64_t gatheredBytes_ = 0;
  /// The buffer of each fused gather call the recorded run issued (Gloo's [world, total]; none on
  /// NCCL), held from its prefetch until the first wait on one of its members, as the simulator
  /// holds a plan's (RuntimeMemory::gatherScratchUntilWait): its members and its bytes.
  std::vector<std::pair<std::vector<int64_t>, uint64_t>> calls_;
  uint64_t callBuffers_ = 0;
  uint64_t filling_ = 0;   ///< reduce bytes of the bucket being filled
  uint64_t held_ = 0;      ///< ZeRO-2/3: the last launched bucket, until the next launch
  uint64_t deferred_ = 0;  ///< ZeRO-2/3: gradients held until their bucket is packed
  std::vector<int64_t> members_;
  std::unordered_map<int64_t, char> hasShardGrad_;
  uint64_t shardGrads_ = 0;
  uint64_t flatBufferBytes_ = 0;  ///< ZeRO-1
  uint64_t flat_ = 0;
  bool allocated_[2] = {false, false};
  int current_ = 0;
};

}  // namespace dcplan::planner::detail
