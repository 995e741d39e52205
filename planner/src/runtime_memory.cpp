// The runtime's transient buffers and allocator rounding, per transport.
#include "dcplan/planner/runtime_memory.h"

namespace dcplan::planner {

namespace {
constexpr uint64_t kCudaBlockBytes = 512;  // CUDACachingAllocator's kMinBlockSize
}  // namespace

RuntimeMemory RuntimeMemory::of(const schemas::TraceMeta& meta, int64_t worldSize) {
  RuntimeMemory m;
  const bool gloo = meta.backend == "gloo" || (meta.backend.empty() && meta.device == "cpu");
  m.transport = gloo ? Transport::Gloo : Transport::Nccl;
  m.worldSize = worldSize > 0 ? worldSize : 1;
  // dcplan's shards are fp32; a gather in any other dtype casts them first.
  m.castsShards = !meta.paramDtype.empty() && meta.paramDtype != "float32";
  return m;
}

uint64_t RuntimeMemory::allocation(uint64_t bytes) const {
  if (transport == Transport::Gloo || bytes == 0) return bytes;
  return (bytes + kCudaBlockBytes - 1) / kCudaBlockBytes * kCudaBlockBytes;
}

uint64_t RuntimeMemory::gatherScratchIssued(uint64_t callBytes, bool coalesced) const {
  const uint64_t shards = callBytes / static_cast<uint64_t>(worldSize);
  return castsShards ? shards : 0;
}

uint64_t RuntimeMemory::gatherScratchUntilWait(uint64_t callBytes, bool coalesced) const {
  if (transport != Transport::Gloo) return 0;
  const uint64_t shards = callBytes / static_cast<uint64_t>(worldSize);
  return callBytes + (coalesced ? callBytes + shards : 0);
}

uint64_t RuntimeMemory::reduceScatterScratch(uint64_t bucketBytes) const {
  if (transport != Transport::Gloo) return 0;
  return bucketBytes / static_cast<uint64_t>(worldSize) * static_cast<uint64_t>(worldSize - 1);
}

}  // namespace dcplan::planner
