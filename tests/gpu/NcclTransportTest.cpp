// GoogleTest of the NCCL transport on 2 GPUs, one thread per rank; skipped without 2 GPUs.
#include "dcplan/replayer/Transport.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace dcplan::replayer {
namespace {

constexpr int kWorld = 2;

/// Runs body(rank, transport) on kWorld threads, each on its GPU and its rank of one
/// communicator; returns the first error of each rank ("" when none).
std::vector<std::string> onRanks(const std::function<void(int, Transport&)>& body) {
  const std::string id = makeNcclUniqueId();
  std::vector<std::string> errors(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      try {
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(r));
        auto transport = makeNcclTransport(id, r, kWorld, r);
        body(r, *transport);
        c10::cuda::device_synchronize();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

at::TensorOptions on(int rank, at::ScalarType t = at::kFloat) {
  return at::TensorOptions().dtype(t).device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(rank)));
}

TEST(NcclTransport, GathersReducesAndCopies) {
  if (!hasNcclTransport()) GTEST_SKIP() << "built without CUDA";
  if (c10::cuda::device_count() < kWorld)
    GTEST_SKIP() << "needs 2 CUDA GPUs, found " << int(c10::cuda::device_count());
  auto errors = onRanks([](int r, Transport& t) {
    EXPECT_EQ(t.worldSize(), kWorld);
    EXPECT_EQ(t.backendName(), "nccl");
    // Plain gather: rank r contributes [3r, 3r+3).
    at::Tensor in = at::arange(3 * r, 3 * r + 3, on(r));
    at::Tensor out = at::full({6}, -1.0, on(r));
    t.allGather(out, in)->wait();
    EXPECT_TRUE(at::equal(out.cpu(), at::arange(0, 6, at::kFloat))) << out;

    // Shard gathers (fp32 shards into bf16 buffers), after a write the gather must see.
    at::Tensor a = at::zeros({5}, on(r));
    at::Tensor b = at::zeros({1}, on(r));
    a.fill_(r + 1);
    b.fill_(10 * (r + 1));
    t.shardsWritten();
    at::Tensor ga = t.newGatherBuffer(10, on(r, at::kBFloat16));
    at::Tensor gb = t.newGatherBuffer(2, on(r, at::kBFloat16));
    t.gatherShards({ga, gb}, {a, b})->wait();
    EXPECT_TRUE(at::equal(ga.cpu(), at::cat({at::full({5}, 1.0), at::full({5}, 2.0)}).to(at::kBFloat16)));
    EXPECT_TRUE(at::equal(gb.cpu(), at::tensor({10.0f, 20.0f}).to(at::kBFloat16)));

    // Reduce-scatter of a bucket whose rows are strided (3 of 8 columns used).
    at::Tensor bucket = at::zeros({kWorld, 8}, on(r));
    at::Tensor used = bucket.narrow(1, 0, 3);
    used.copy_(at::arange(6, on(r)).view({kWorld, 3}) * (r + 1));
    at::Tensor mine = at::empty({3}, on(r));
    t.reduceScatter(mine, used)->wait();
    EXPECT_TRUE(at::equal(mine.cpu(), (at::arange(3 * r, 3 * r + 3, at::kFloat) * 3)));

    // In-place all-reduce.
    at::Tensor x = at::full({4}, double(r + 1), on(r));
    t.allReduce(x)->wait();
    EXPECT_TRUE(at::equal(x.cpu(), at::full({4}, 3.0)));

    // Offload to pinned memory and back.
    at::Tensor dev = at::randn({257}, on(r));
    at::Tensor host = at::empty({257}, at::TensorOptions().pinned_memory(true));
    t.copyAsync(host, dev, Transport::CopyKind::Offload)->wait();
    EXPECT_TRUE(at::equal(host, dev.cpu()));
    at::Tensor back = at::empty({257}, on(r));
    t.copyAsync(back, host, Transport::CopyKind::Reload)->wait();
    EXPECT_TRUE(at::equal(back.cpu(), host));

    // Errors name the op and what is wrong.
    try {
      t.allGather(at::empty({5}, on(r)), in);
      ADD_FAILURE() << "allGather with a wrong output size did not throw";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("allGather: output should have world_size * 3 elements, got 5"),
                std::string::npos)
          << e.what();
    }
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(NcclTransport, RejectsABadUniqueId) {
  if (!hasNcclTransport()) GTEST_SKIP() << "built without CUDA";
  try {
    makeNcclTransport("short", 0, 1, 0);
    ADD_FAILURE() << "a 5-byte unique id was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("init_nccl: unique_id should have 128 bytes"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace dcplan::replayer
