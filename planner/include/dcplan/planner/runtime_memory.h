// What the runtime allocates around its collectives, per transport: the memory model's rules for
// the buffers that are neither gathered parameters, buckets nor activations (docs/planning.md).
#pragma once

#include <cstdint>

#include "dcplan/schemas/trace.h"

namespace dcplan::planner {

/// The transient buffers of the runtime's collectives and the allocator's rounding, as measured
/// against the runtime's allocation log (the replay log's per-op memory, tests/replay).
struct RuntimeMemory {
  enum class Transport { Gloo, Nccl };

  Transport transport = Transport::Nccl;
  int64_t worldSize = 1;
  bool castsShards = false;  ///< gathers in another dtype than the fp32 shards: a cast copy each

  /// The rules of the trace's transport (meta.backend; without one, meta.device "cpu" is Gloo).
  static RuntimeMemory of(const schemas::TraceMeta& meta, int64_t worldSize);

  /// Bytes an allocation of `bytes` takes: the CUDA caching allocator rounds every block up to
  /// 512 bytes; the CPU allocator is counted by the bytes asked for.
  uint64_t allocation(uint64_t bytes) const;

  /// Scratch of one gather call of `callBytes` (the gathered size of its members) while it is
  /// issued (counted in the memory right after the op that issues it): the shards cast to the
  /// gather dtype (a shard's size each) when castsShards. On NCCL the host frees them once the
  /// kernels are queued, and the caching allocator's statistics count them as freed then; Gloo's
  /// work holds them until it is done.
  uint64_t gatherScratchIssued(uint64_t callBytes, bool coalesced) const;
  /// Scratch of a gather call held until one of its members is waited on. Gloo: its allgather
  /// gathers into a flat buffer of the call's size, which its work holds until the wait releases
  /// the work; a call of several members (allGatherCoalesced) also holds their concatenated
  /// shards and a [world, total] output of the runtime's own, which the wait scatters into the
  /// parameters. NCCL: nothing (each member gathers in place).
  uint64_t gatherScratchUntilWait(uint64_t callBytes, bool coalesced) const;

  /// Scratch of a bucket's reduce-scatter (ZeRO-2/3) of `bucketBytes`: Gloo reduces the rows of
  /// the other ranks through a buffer of (world - 1) shards; NCCL reduces in place. An
  /// all-reduce (ZeRO-1) needs none on either.
  uint64_t reduceScatterScratch(uint64_t bucketBytes) const;
};

}  // namespace dcplan::planner
