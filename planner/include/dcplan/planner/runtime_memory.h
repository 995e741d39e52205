// What the runtime allocates around its collectives, per transport: the memory model's rules for
// the buffers that are neither gathered parameters, buckets nor activations (docs/planning.md).
#pragma once

#include <cstdint>

#include "dcplan/schemas/trace.h"

namespace dcplan::planner {

/// The transient buffers of the runtime's collectives and the allocator's rounding, as measured
/// against the runtime's allocation log (the replay log's per-op memory, tests/replay).
/// What the runtime allocates for one parameter (RuntimeMemory::param).
struct ParamMemory {
  uint64_t gathered = 0;   ///< the gathered copy: padded, gather dtype
  uint64_t gradient = 0;   ///< autograd's gradient handed to reduce_grad: numel, gather dtype
  uint64_t output = 0;     ///< ZeRO-2/3: its slice of a reduce-scatter output: a shard, reduce dtype
  uint64_t shardGrad = 0;  ///< the shard's gradient: a shard in fp32, the shards' dtype
  uint64_t master = 0;     ///< the fp32 master shard itself (what a planned master offload moves)
};

/// What one reduction of a parameter leaves behind.
struct ReducedMemory {
  uint64_t held = 0;  ///< with its bucket, until the next launch or end_backward
  uint64_t kept = 0;  ///< until the optimizer step: the shard's new gradient
};

struct RuntimeMemory {
  enum class Transport { Gloo, Nccl };

  Transport transport = Transport::Nccl;
  int64_t worldSize = 1;
  int64_t stage = 3;
  bool castsShards = false;  ///< gathers in another dtype than the fp32 shards: a cast copy each
  uint64_t gatherSize = 4;   ///< bytes per element gathered
  uint64_t reduceSize = 4;   ///< bytes per element reduced

  /// The rules of the trace's transport (meta.backend; without one, meta.device "cpu" is Gloo),
  /// stage and dtypes, on worldSize ranks.
  static RuntimeMemory of(const schemas::TraceMeta& meta, int64_t worldSize);

  /// The sizes of what the runtime allocates for a parameter of numel elements (shards of
  /// ceil(numel / worldSize), padded), allocator rounding included.
  ParamMemory param(int64_t numel) const;

  /// What a reduction of p leaves; first: its first in the optimizer step (the shard has no
  /// gradient yet). ZeRO-2/3: later reductions add the output into the shard's gradient, and the
  /// output is held with the bucket; the first makes the output slice itself the gradient when it
  /// is fp32 (kept: it keeps the whole output alive), else a new fp32 shard (kept) next to the
  /// output (held). ZeRO-1 all-reduces in place: the first makes a new fp32 shard.
  ReducedMemory reduced(const ParamMemory& p, bool first) const;

  /// Bytes an allocation of `bytes` takes: the CUDA caching allocator rounds every block up to
  /// 512 bytes; the CPU allocator is counted by the bytes asked for.
  uint64_t allocation(uint64_t bytes) const;

  /// Scratch of one gather call of `callBytes` (the gathered size of its members) while it is
  /// issued (counted in the memory right after the op that issues it): on Gloo, its members' shards
  /// cast to the gather dtype (a shard's size each) when castsShards, freed once copied into the
  /// call's buffer. NCCL casts each shard into its slot of the gathered buffer: none.
  uint64_t gatherScratchIssued(uint64_t callBytes) const;
  /// Scratch of a gather call held until one of its members is waited on. Gloo: a call of several
  /// members (allGatherCoalesced) gathers into a [world, total] buffer of the runtime's own, which
  /// the wait copies into the parameters; a single gather broadcasts each rank's row of its output
  /// in place (the transport never uses Gloo's allgather, whose worker thread allocates a buffer
  /// of the output's size whenever it runs). NCCL: nothing (each member gathers in place).
  uint64_t gatherScratchUntilWait(uint64_t callBytes, bool coalesced) const;

  /// ZeRO-2/3 at one rank: the reduction is the identity, so the packed bucket is its own output
  /// (no input buffer beside the output slices, no collective; the runtime's launchReduce).
  bool packsIntoOutput() const { return stage >= 2 && worldSize == 1; }
  /// A launched ZeRO-2/3 bucket's packed input, held beside its output: `bucketBytes` in one
  /// allocation, none where it is its own output (packsIntoOutput).
  uint64_t packedInput(uint64_t bucketBytes) const { return packsIntoOutput() ? 0 : allocation(bucketBytes); }

  /// Scratch of a bucket's reduce-scatter (ZeRO-2/3) of `bucketBytes`: Gloo reduces the rows of
  /// the other ranks through a buffer of (world - 1) shards; NCCL reduces in place. An
  /// all-reduce (ZeRO-1) needs none on either.
  uint64_t reduceScatterScratch(uint64_t bucketBytes) const;
};

}  // namespace dcplan::planner
