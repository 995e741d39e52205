// The runtime's transient buffers and allocator rounding, per transport.
#include "dcplan/planner/runtime_memory.h"

#include "dcplan/schemas/dtype.h"

namespace dcplan::planner {

namespace {
constexpr uint64_t kCudaBlockBytes = 512;  // CUDACachingAllocator's kMinBlockSize
}  // namespace

RuntimeMemory RuntimeMemory::of(const schemas::TraceMeta& meta, int64_t worldSize) {
  RuntimeMemory m;
  const bool gloo = meta.backend == "gloo" || (meta.backend.empty() && meta.device == "cpu");
  m.transport = gloo ? Transport::Gloo : Transport::Nccl;
  m.worldSize = worldSize > 0 ? worldSize : 1;
  m.stage = meta.stage;
  // dcplan's shards are fp32; a gather in any other dtype casts them first.
  m.castsShards = !meta.paramDtype.empty() && meta.paramDtype != "float32";
  m.gatherSize = static_cast<uint64_t>(schemas::dtypeSize(meta.paramDtype).value_or(4));
  m.reduceSize = static_cast<uint64_t>(schemas::dtypeSize(meta.reduceDtype).value_or(4));
  return m;
}

ParamMemory RuntimeMemory::param(int64_t numel) const {
  const uint64_t ranks = static_cast<uint64_t>(worldSize);
  const uint64_t shard = (static_cast<uint64_t>(numel) + ranks - 1) / ranks;
  ParamMemory p;
  p.gathered = allocation(shard * ranks * gatherSize);
  p.gradient = allocation(static_cast<uint64_t>(numel) * gatherSize);
  p.output = allocation(shard * reduceSize);
  p.shardGrad = allocation(shard * 4);
  p.master = allocation(shard * 4);
  return p;
}

ReducedMemory RuntimeMemory::reduced(const ParamMemory& p, bool first) const {
  ReducedMemory r;
  if (stage < 2) {
    r.kept = first ? p.shardGrad : 0;
    return r;
  }
  if (!first) {
    r.held = p.output;
  } else if (reduceSize == 4) {
    r.kept = p.output;
  } else {
    r.kept = p.shardGrad;
    r.held = p.output;
  }
  return r;
}

uint64_t RuntimeMemory::allocation(uint64_t bytes) const {
  if (transport == Transport::Gloo || bytes == 0) return bytes;
  return (bytes + kCudaBlockBytes - 1) / kCudaBlockBytes * kCudaBlockBytes;
}

uint64_t RuntimeMemory::gatherScratchIssued(uint64_t callBytes) const {
  // NCCL casts each shard straight into its slot of the gathered buffer: no scratch.
  if (transport != Transport::Gloo) return 0;
  return castsShards ? allocation(callBytes / static_cast<uint64_t>(worldSize)) : 0;
}

uint64_t RuntimeMemory::gatherScratchUntilWait(uint64_t callBytes, bool coalesced) const {
  return transport == Transport::Gloo && coalesced ? callBytes : 0;
}

uint64_t RuntimeMemory::reduceScatterScratch(uint64_t bucketBytes) const {
  if (transport != Transport::Gloo) return 0;
  return bucketBytes / static_cast<uint64_t>(worldSize) * static_cast<uint64_t>(worldSize - 1);
}

}  // namespace dcplan::planner
