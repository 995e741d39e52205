// Unit tests of the runtime classes, one thread per rank over an in-memory transport.
#include "RuntimeState.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <barrier>
#include <functional>
#include <memory>
#include <thread>

using namespace dcplan::replayer;

namespace {

/// Ranks are threads of this process; a collective publishes each rank's
/// input, waits for all, then every rank computes its own output.
struct Rendezvous {
  explicit Rendezvous(int ws) : worldSize(ws), barrier(ws), slots(ws) {}
  int worldSize;
  std::barrier<> barrier;
  std::vector<at::Tensor> slots;
};

class DoneHandle final : public CommHandle {
 public:
  void wait() override {}
  bool isCompleted() override { return true; }
};

/// Work a device has not run yet: completed only once the host synchronizes on it.
class PendingHandle final : public CommHandle {
 public:
  explicit PendingHandle(int* syncs) : syncs_(syncs) {}
  void wait() override {}
  bool isCompleted() override { return done_; }
  void synchronize() override {
    done_ = true;
    ++*syncs_;
  }

 private:
  int* syncs_;
  bool done_ = false;
};

class ThreadTransport final : public Transport {
 public:
  ThreadTransport(std::shared_ptr<Rendezvous> rv, int rank) : rv_(std::move(rv)), rank_(rank) {}
  int rank() const override { return rank_; }
  int worldSize() const override { return rv_->worldSize; }
  std::string backendName() const override { return "threads"; }

  CommHandlePtr allGather(const at::Tensor& output, const at::Tensor& input) override {
    publish(input);
    const int64_t n = input.numel();
    for (int r = 0; r < rv_->worldSize; ++r) output.narrow(0, r * n, n).copy_(rv_->slots[r]);
    return finish();
  }
  CommHandlePtr allGatherCoalesced(const std::vector<at::Tensor>& outputs,
                                   const std::vector<at::Tensor>& inputs) override {
    ++coalescedCalls_;
    for (size_t i = 0; i < inputs.size(); ++i) allGather(outputs[i], inputs[i]);
    return std::make_shared<DoneHandle>();
  }
  CommHandlePtr reduceScatter(const at::Tensor& output, const at::Tensor& input) override {
    ++reduceCalls_;
    if (reducesAloneInPlace(output, input)) {  // one rank's bucket, its own output (launchReduce)
      ++inPlaceReduces_;
      return std::make_shared<DoneHandle>();
    }
    publish(input);
    output.zero_();
    for (int r = 0; r < rv_->worldSize; ++r) output.add_(rv_->slots[r].select(0, rank_));
    return finish();
  }
  CommHandlePtr allReduce(const at::Tensor& tensor) override {
    ++reduceCalls_;
    publish(tensor.clone());
    tensor.zero_();
    for (int r = 0; r < rv_->worldSize; ++r) tensor.add_(rv_->slots[r]);
    return finish();
  }

  /// With lagging_, the caller's work is never done until synchronized (a device far behind).
  CommHandlePtr markCaller() override {
    if (!lagging_) return Transport::markCaller();
    return std::make_shared<PendingHandle>(&hostSyncs_);
  }

  int coalescedCalls_ = 0;
  int reduceCalls_ = 0;
  int inPlaceReduces_ = 0;
  bool lagging_ = false;
  int hostSyncs_ = 0;

 private:
  void publish(const at::Tensor& t) {
    rv_->slots[rank_] = t;
    rv_->barrier.arrive_and_wait();
  }
  CommHandlePtr finish() {
    rv_->barrier.arrive_and_wait();  // nobody overwrites a slot still being read
    return std::make_shared<DoneHandle>();
  }

  std::shared_ptr<Rendezvous> rv_;
  int rank_;
};

/// One rank's runtime state, built without the process-wide runtime.
struct Rank {
  Rank(std::shared_ptr<Rendezvous> rv, int rank, int64_t bucketBytes) {
    transport = std::make_shared<ThreadTransport>(rv, rank);
    state.transport_ = transport;
    state.config_.reduceBucketBytes = bucketBytes;
    state.registry_ =
        std::make_unique<ParamRegistry>(rv->worldSize, *transport, state.config_.maxReleaseLagBytes);
    state.schedule_ = std::make_unique<SchedulePolicy>();
  }
  std::shared_ptr<ThreadTransport> transport;
  RuntimeState state;
};

void runRanks(int ws, const std::function<void(int rank, const std::shared_ptr<Rendezvous>&)>& body) {
  auto rv = std::make_shared<Rendezvous>(ws);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(ws);
  for (int r = 0; r < ws; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r, rv);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < ws; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

const std::vector<std::vector<int64_t>> kShapes = {{5}, {3, 3}, {1}, {2, 7}};

at::Tensor fullValue(size_t i) {
  int64_t numel = 1;
  for (int64_t d : kShapes[i]) numel *= d;
  return at::arange(numel, at::kFloat) + 100.0 * static_cast<double>(i);
}

/// Registers kShapes with this rank's slice of fullValue(i); returns grad buffers.
std::vector<at::Tensor> registerAll(Rank& rk, int rank, int ws) {
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    at::Tensor full = fullValue(i);
    const int64_t s = shardNumelOf(full.numel(), ws);
    at::Tensor shard = at::zeros({s});
    const int64_t lo = std::min<int64_t>(rank * s, full.numel());
    const int64_t hi = std::min<int64_t>(lo + s, full.numel());
    shard.narrow(0, 0, hi - lo).copy_(full.narrow(0, lo, hi - lo));
    grads.push_back(at::zeros({s}));
    rk.state.registry_->registerParam(static_cast<int64_t>(i), kShapes[i], shard, grads.back(), false);
  }
  return grads;
}

}  // namespace

TEST(ReduceBucket, RankMajorRegionsAreColumnsAndSurviveGrowth) {
  ReduceBucket b(at::kFloat, at::kCPU, 2, /*rankMajor=*/true, /*capacityBytes=*/16);  // 2 columns
  at::Tensor r0 = b.allocate(7, 2);
  r0.copy_(at::arange(4, at::kFloat).view({2, 2}));
  at::Tensor r1 = b.allocate(8, 3);  // grows past the capacity
  r1.fill_(9);
  at::Tensor in = b.commInput();
  ASSERT_EQ(in.sizes(), (std::vector<int64_t>{2, 5}));
  EXPECT_TRUE(in.select(0, 1).is_contiguous());
  EXPECT_TRUE(at::equal(in.select(0, 0), at::tensor({0.f, 1.f, 9.f, 9.f, 9.f})));
  EXPECT_TRUE(at::equal(in.select(0, 1), at::tensor({2.f, 3.f, 9.f, 9.f, 9.f})));
  EXPECT_EQ(b.usedBytes(), 2 * 5 * 4);
  b.reset();
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(b.usedBytes(), 0);
}

TEST(ReduceBucket, DeferredGradientsPackIntoRankMajorRowsWithPadding) {
  ReduceBucket b(at::kFloat, at::kCPU, 2, /*rankMajor=*/true, /*capacityBytes=*/1 << 20);
  b.defer(3, 3, at::arange(5, at::kBFloat16));       // 5 elements: 3 + 2 and a zero
  b.defer(4, 2, at::arange(10, 14, at::kBFloat16));  // 4 elements: 2 + 2
  EXPECT_EQ(b.usedBytes(), 2 * 5 * 4);               // counted while the gradients wait
  b.pack();
  at::Tensor in = b.commInput();
  ASSERT_EQ(in.sizes(), (std::vector<int64_t>{2, 5}));
  EXPECT_TRUE(in.is_contiguous());  // the collective reads it as it is
  EXPECT_TRUE(at::equal(in.select(0, 0), at::tensor({0.f, 1.f, 2.f, 10.f, 11.f})));
  EXPECT_TRUE(at::equal(in.select(0, 1), at::tensor({3.f, 4.f, 0.f, 12.f, 13.f})));
  EXPECT_EQ(b.tasks()[1].colOffset_, 3);
  b.reset();
  b.releaseMemory();
  b.defer(5, 1, at::ones({2}, at::kFloat));  // fills again after a flush
  b.pack();
  EXPECT_TRUE(at::equal(b.commInput(), at::ones({2, 1}, at::kFloat)));
}

TEST(ReduceBucket, FlatRegionsAreConsecutive) {
  ReduceBucket b(at::kFloat, at::kCPU, 3, /*rankMajor=*/false, 1024);
  b.allocate(0, 2).fill_(1);
  b.allocate(1, 1).fill_(2);
  EXPECT_TRUE(at::equal(b.commInput(), at::tensor({1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 2.f, 2.f, 2.f})));
}

TEST(ParamRegistry, BoundsReleasedCopiesTheDeviceHasNotUsedYet) {
  auto rv = std::make_shared<Rendezvous>(1);
  ThreadTransport transport(rv, 0);
  transport.lagging_ = true;
  ParamRegistry reg(1, transport, /*maxReleaseLagBytes=*/100);  // one 64-byte copy fits, two do not
  for (int64_t id = 0; id < 4; ++id) reg.registerParam(id, {16}, at::zeros({16}), at::Tensor(), false);
  reg.startGather(reg.get("t", 0), at::kFloat, transport);
  reg.dropGathered(reg.get("t", 0));  // 64 bytes released, not yet used up
  reg.startGather(reg.get("t", 1), at::kFloat, transport);
  EXPECT_EQ(transport.hostSyncs_, 0);
  reg.dropGathered(reg.get("t", 1));  // 128 bytes: over the bound
  reg.startGather(reg.get("t", 2), at::kFloat, transport);
  EXPECT_EQ(transport.hostSyncs_, 1);  // the host waited for the oldest release only
  reg.dropGathered(reg.get("t", 2));
  reg.startGather(reg.get("t", 3), at::kFloat, transport);
  EXPECT_EQ(transport.hostSyncs_, 2);
  // A host transport's work is done when queued: nothing to wait for.
  transport.lagging_ = false;
  ParamRegistry host(1, transport, 0);
  host.registerParam(0, {16}, at::zeros({16}), at::Tensor(), false);
  for (int k = 0; k < 3; ++k) {
    host.startGather(host.get("t", 0), at::kFloat, transport);
    host.dropGathered(host.get("t", 0));
  }
  EXPECT_EQ(transport.hostSyncs_, 2);
}

TEST(ParamRegistry, RejectsBadRegistrations) {
  auto rv = std::make_shared<Rendezvous>(3);
  ThreadTransport transport(rv, 0);
  ParamRegistry reg(3, transport, RuntimeConfig{}.maxReleaseLagBytes);
  reg.registerParam(0, {2, 3}, at::zeros({2}), at::Tensor(), false);
  EXPECT_THROW(reg.registerParam(0, {2, 3}, at::zeros({2}), at::Tensor(), false), c10::Error);
  try {
    reg.registerParam(1, {7}, at::zeros({2}), at::Tensor(), false);
    FAIL() << "a shard of the wrong size was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("ds_tensor should have ceil(numel/world_size) = 3"),
              std::string::npos);
  }
  EXPECT_THROW(reg.get("allgather_param", 5), c10::Error);
}

class ExecutorOnRanks : public ::testing::TestWithParam<int> {};

TEST_P(ExecutorOnRanks, Zero3GathersPaddedAndReduceScattersMeans) {
  const int ws = GetParam();
  runRanks(ws, [ws](int rank, const std::shared_ptr<Rendezvous>& rv) {
    Rank rk(rv, rank, /*bucketBytes=*/48);  // small: several flushes, both buffers used
    std::vector<at::Tensor> grads = registerAll(rk, rank, ws);
    ShardedGradExecutor ex(0, Stage::Zero3, {0, 1, 2, 3}, std::nullopt, rk.state);
    for (size_t i = 0; i < kShapes.size(); ++i) {
      at::Tensor g = ex.allgatherParam(rk.state.registry_->get("t", i).shard_, i, std::nullopt);
      ex.waitAllgather(g, i);
      ASSERT_TRUE(at::equal(g.reshape({-1}), fullValue(i))) << "param " << i;
      ex.releaseParam(i, 1);
      ASSERT_FALSE(rk.state.registry_->get("t", i).hasGathered());
    }
    ex.startBackward(/*sync=*/true);           // fresh parameters: the first reduction overwrites
    for (int round = 0; round < 2; ++round) {  // a parameter used twice: gradients add
      for (size_t i = 0; i < kShapes.size(); ++i) ex.reduceGrad(at::full(kShapes[i], rank + 1.0), i);
    }
    ex.endBackward();
    EXPECT_GT(rk.transport->reduceCalls_, 1);
    // One rank's buckets are each their own output: reduced in place, nothing copied.
    EXPECT_EQ(rk.transport->inPlaceReduces_, ws == 1 ? rk.transport->reduceCalls_ : 0);
    const double mean = 2.0 * (ws + 1) / 2.0;
    for (size_t i = 0; i < kShapes.size(); ++i) {
      const int64_t numel = fullValue(i).numel();
      const int64_t s = shardNumelOf(numel, ws);
      const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(s, numel - rank * s));
      at::Tensor want = at::zeros({s});
      want.narrow(0, 0, valid).fill_(mean);
      EXPECT_TRUE(at::allclose(grads[i], want)) << "rank " << rank << " param " << i << ": " << grads[i];
    }
  });
}

TEST_P(ExecutorOnRanks, Zero1ReducesOnlyAtTheBoundary) {
  const int ws = GetParam();
  runRanks(ws, [ws](int rank, const std::shared_ptr<Rendezvous>& rv) {
    Rank rk(rv, rank, 1024);
    std::vector<at::Tensor> grads = registerAll(rk, rank, ws);
    Zero1Executor ex(1, Stage::Zero1, {0, 1, 2, 3}, std::nullopt, rk.state);
    for (int micro = 0; micro < 3; ++micro) {
      const bool boundary = micro == 2;
      ex.startBackward(boundary);
      for (size_t i = 0; i < kShapes.size(); ++i) ex.reduceGrad(at::full(kShapes[i], rank + 1.0), i);
      ex.endBackward();
      if (!boundary) {
        EXPECT_EQ(rk.transport->reduceCalls_, 0);
      }
    }
    EXPECT_EQ(rk.transport->reduceCalls_, 1);  // one bucket, one all-reduce
    const double mean = 3.0 * (ws + 1) / 2.0;
    for (size_t i = 0; i < kShapes.size(); ++i) {
      const int64_t numel = fullValue(i).numel();
      const int64_t s = shardNumelOf(numel, ws);
      const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(s, numel - rank * s));
      at::Tensor want = at::zeros({s});
      want.narrow(0, 0, valid).fill_(mean);
      EXPECT_TRUE(at::allclose(grads[i], want)) << "rank " << rank << " param " << i;
    }
    // ZeRO-1 keeps parameters gathered after the last release.
    at::Tensor g = ex.allgatherParam(rk.state.registry_->get("t", 1).shard_, 1, at::kBFloat16);
    ex.waitAllgather(g, 1);
    ex.releaseParam(1, 1);
    EXPECT_TRUE(rk.state.registry_->get("t", 1).hasGathered());
    EXPECT_EQ(g.scalar_type(), at::kBFloat16);
  });
}

TEST_P(ExecutorOnRanks, FusedPrefetchIsOneGroupCall) {
  const int ws = GetParam();
  runRanks(ws, [ws](int rank, const std::shared_ptr<Rendezvous>& rv) {
    Rank rk(rv, rank, 1024);
    registerAll(rk, rank, ws);
    ShardedGradExecutor ex(0, Stage::Zero3, {0, 1, 2, 3}, std::nullopt, rk.state);
    ex.prefetchParamsFused({0, 2, 3}, {at::kFloat, at::kFloat, at::kFloat});
    EXPECT_EQ(rk.transport->coalescedCalls_, 1);
    for (int64_t i : {0, 2, 3}) {
      at::Tensor g = ex.allgatherParam(rk.state.registry_->get("t", i).shard_, i, std::nullopt);
      ex.waitAllgather(g, i);
      EXPECT_TRUE(at::equal(g.reshape({-1}), fullValue(i)));
    }
    EXPECT_FALSE(rk.state.registry_->get("t", 1).hasGathered());
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ExecutorOnRanks, ::testing::Values(1, 2, 3));

namespace {

struct KeepAndFlushEverything final : SchedulePolicy {
  bool keepGathered(int64_t, bool, bool, bool) override { return true; }
  bool flushBefore(int64_t, int64_t pendingBytes, int64_t, int64_t) override { return pendingBytes > 0; }
  std::vector<int64_t> prefetchBefore(const OpEvent& e) override {
    return e.dsId == 0 ? std::vector<int64_t>{3} : std::vector<int64_t>{};
  }
};

struct RecordingObserver final : OpObserver {
  void onOpBegin(const OpEvent& e) override {
    ops.push_back(std::string(e.op) + ":" + std::to_string(e.dsId));
  }
  void onStartForward() override { ops.push_back("start_forward"); }
  void onStartBackward(bool update, bool sync) override {
    ops.push_back(std::string("start_backward:") + (update ? "u" : "") + (sync ? "s" : ""));
  }
  std::vector<std::string> ops;
};

}  // namespace

TEST(Runtime, ScheduleAndObserverSeams) {
  auto rv = std::make_shared<Rendezvous>(1);
  init(std::make_shared<ThreadTransport>(rv, 0), RuntimeConfig{});
  auto observer = std::make_shared<RecordingObserver>();
  setObserver(observer);
  setSchedule(std::make_unique<KeepAndFlushEverything>());
  at::Tensor g0 = at::zeros({4}), g3 = at::zeros({2});
  registerParam(0, {4}, at::ones({4}), g0, false);
  registerParam(3, {2}, at::ones({2}), g3, false);
  registerGraph(0, Stage::Zero3, {0, 3});
  startForward();
  at::Tensor p = allgatherParam(at::ones({4}), 0, 0, std::nullopt);
  waitAllgather(p, 0, 0);
  EXPECT_EQ(gatheredParamIds(), (std::vector<int64_t>{0, 3}));  // 3 prefetched by the schedule
  releaseParam(at::Tensor(), 0, 0, 1);
  EXPECT_EQ(gatheredParamIds(), (std::vector<int64_t>{0, 3}));  // kept by the schedule
  startBackward(true, true);
  reduceGrad(at::full({4}, 2.0), 0, 0);
  reduceGrad(at::full({2}, 3.0), 0, 3);
  endBackward(0);
  EXPECT_TRUE(at::equal(g0, at::full({4}, 2.0)));
  EXPECT_TRUE(at::equal(g3, at::full({2}, 3.0)));
  EXPECT_EQ(observer->ops, (std::vector<std::string>{"start_forward", "allgather_param:0", "wait_allgather:0",
                                                     "release_param:0", "start_backward:us", "reduce_grad:0",
                                                     "reduce_grad:3", "end_backward:-1"}));
  EXPECT_THROW(init(std::make_shared<ThreadTransport>(rv, 0), RuntimeConfig{}), c10::Error);
  cleanup();
  EXPECT_FALSE(isInitialized());
  try {
    endBackward(0);
    FAIL() << "end_backward ran without a runtime";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("end_backward: the dc runtime is not initialized"),
              std::string::npos);
  }
}
