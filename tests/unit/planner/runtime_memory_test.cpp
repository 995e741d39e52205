// The transports' memory rules (measured on Gloo ranks against the counting CPU allocator; NCCL's
// from the CUDA caching allocator's block size and the runtime's in-place gathers).
#include <gtest/gtest.h>

#include "dcplan/planner/runtime_memory.h"

namespace dcplan::planner {
namespace {

schemas::TraceMeta meta(const char* backend, const char* device, const char* paramDtype) {
  schemas::TraceMeta m;
  m.backend = backend;
  m.device = device;
  m.paramDtype = paramDtype;
  return m;
}

TEST(RuntimeMemory, TheTransportComesFromTheBackendOrTheDevice) {
  EXPECT_EQ(RuntimeMemory::of(meta("gloo", "cpu", "float32"), 2).transport, RuntimeMemory::Transport::Gloo);
  EXPECT_EQ(RuntimeMemory::of(meta("nccl", "NVIDIA H200", "float32"), 2).transport,
            RuntimeMemory::Transport::Nccl);
  EXPECT_EQ(RuntimeMemory::of(meta("", "cpu", "float32"), 2).transport, RuntimeMemory::Transport::Gloo);
  EXPECT_EQ(RuntimeMemory::of(meta("", "NVIDIA H200", "float32"), 2).transport,
            RuntimeMemory::Transport::Nccl);
  EXPECT_FALSE(RuntimeMemory::of(meta("nccl", "x", "float32"), 2).castsShards);
  EXPECT_TRUE(RuntimeMemory::of(meta("nccl", "x", "bfloat16"), 2).castsShards);
}

TEST(RuntimeMemory, CudaBlocksAreRoundedTo512BytesAndCpuBytesAreExact) {
  const RuntimeMemory nccl = RuntimeMemory::of(meta("nccl", "x", "float32"), 2);
  EXPECT_EQ(nccl.allocation(0), 0u);
  EXPECT_EQ(nccl.allocation(1), 512u);
  EXPECT_EQ(nccl.allocation(512), 512u);
  EXPECT_EQ(nccl.allocation(100'000), 100'352u);
  EXPECT_EQ(RuntimeMemory::of(meta("gloo", "cpu", "float32"), 2).allocation(100'000), 100'000u);
}

TEST(RuntimeMemory, GlooHoldsOnlyAFusedCallsBufferUntilItsWait) {
  const RuntimeMemory gloo = RuntimeMemory::of(meta("gloo", "cpu", "float32"), 4);
  // A single gather broadcasts the ranks' rows in its output: nothing else, issued or held.
  EXPECT_EQ(gloo.gatherScratchIssued(4'000), 0u);
  EXPECT_EQ(gloo.gatherScratchUntilWait(4'000, false), 0u);
  // A fused call gathers into a [world, total] buffer of its own, which the wait copies out.
  EXPECT_EQ(gloo.gatherScratchUntilWait(4'000, true), 4'000u);
  // Gloo's reduce-scatter reduces the other ranks' rows through (world - 1) shards.
  EXPECT_EQ(gloo.reduceScatterScratch(4'000), 3'000u);
  // Cast shards exist while the call is issued, single or fused, and are gone by the wait.
  const RuntimeMemory bf16 = RuntimeMemory::of(meta("gloo", "cpu", "bfloat16"), 4);
  EXPECT_EQ(bf16.gatherScratchIssued(4'000), 1'000u);
  EXPECT_EQ(bf16.gatherScratchUntilWait(4'000, false), 0u);
  EXPECT_EQ(bf16.gatherScratchUntilWait(4'000, true), 4'000u);
}

TEST(RuntimeMemory, AReductionLeavesAShardGradientOnceAStep) {
  schemas::TraceMeta m = meta("nccl", "x", "bfloat16");
  m.stage = 3;
  m.reduceDtype = "float32";
  const RuntimeMemory fp32 = RuntimeMemory::of(m, 2);
  const ParamMemory p = fp32.param(10'000);  // shards of 5,000 elements
  EXPECT_EQ(p.gathered, 20'480u);            // 10,000 bf16, in 512-byte blocks
  EXPECT_EQ(p.output, 20'480u);              // 5,000 fp32
  // fp32 reduction: the output slice becomes the gradient the first time, then is added into it.
  EXPECT_EQ(fp32.reduced(p, true).kept, p.output);
  EXPECT_EQ(fp32.reduced(p, true).held, 0u);
  EXPECT_EQ(fp32.reduced(p, false).kept, 0u);
  EXPECT_EQ(fp32.reduced(p, false).held, p.output);
  // bf16 reduction: a new fp32 shard the first time, the bf16 output held with the bucket.
  m.reduceDtype = "bfloat16";
  const RuntimeMemory bf16 = RuntimeMemory::of(m, 2);
  const ParamMemory q = bf16.param(10'000);
  EXPECT_EQ(bf16.reduced(q, true).kept, q.shardGrad);
  EXPECT_EQ(bf16.reduced(q, true).held, q.output);
  EXPECT_EQ(q.shardGrad, 2 * q.output);
  // ZeRO-1 all-reduces in place: only the new fp32 shard.
  m.stage = 1;
  EXPECT_EQ(RuntimeMemory::of(m, 2).reduced(q, true).kept, q.shardGrad);
  EXPECT_EQ(RuntimeMemory::of(m, 2).reduced(q, true).held, 0u);
}

TEST(RuntimeMemory, NcclGathersAndCastsInPlace) {
  const RuntimeMemory fp32 = RuntimeMemory::of(meta("nccl", "x", "float32"), 4);
  EXPECT_EQ(fp32.gatherScratchIssued(4'000), 0u);
  EXPECT_EQ(fp32.gatherScratchUntilWait(4'000, true), 0u);
  EXPECT_EQ(fp32.reduceScatterScratch(4'000), 0u);
  const RuntimeMemory bf16 = RuntimeMemory::of(meta("nccl", "x", "bfloat16"), 4);
  // Each shard is cast straight into its slot of the gathered buffer: no scratch, single or fused.
  EXPECT_EQ(bf16.gatherScratchIssued(4'000), 0u);
  EXPECT_EQ(bf16.gatherScratchUntilWait(4'000, false), 0u);
}

}  // namespace
}  // namespace dcplan::planner
