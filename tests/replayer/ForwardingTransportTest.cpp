// The decorators' base forwards every seam of Transport to the wrapped transport.
#include "dcplan/replayer/ForwardingTransport.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>

using namespace dcplan::replayer;

namespace {

class Handle final : public CommHandle {
 public:
  void wait() override {}
  bool isCompleted() override { return true; }
};

/// Counts each seam it is called through, and returns handles of its own.
class Counting final : public Transport {
 public:
  int rank() const override { return 3; }
  int worldSize() const override { return 4; }
  std::string backendName() const override { return "counting"; }
  CommHandlePtr allGather(const at::Tensor&, const at::Tensor&) override { return hit("allGather"); }
  CommHandlePtr allGatherCoalesced(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&) override {
    return hit("allGatherCoalesced");
  }
  CommHandlePtr reduceScatter(const at::Tensor&, const at::Tensor&) override { return hit("reduceScatter"); }
  CommHandlePtr allReduce(const at::Tensor&) override { return hit("allReduce"); }
  CommHandlePtr gatherShards(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&) override {
    return hit("gatherShards");
  }
  at::Tensor newGatherBuffer(int64_t numel, const at::TensorOptions& options) override {
    hit("newGatherBuffer");
    return at::zeros({numel}, options);
  }
  void shardsWritten() override { hit("shardsWritten"); }
  void reloadShard(const at::Tensor&, const at::Tensor&) override { hit("reloadShard"); }
  CommHandlePtr markCaller() override { return hit("markCaller"); }
  CommHandlePtr runAfter(const CommHandlePtr& done, const std::function<void()>& work) override {
    after = done;
    work();
    return hit("runAfter");
  }
  CommHandlePtr copyAsync(const at::Tensor&, const at::Tensor&, CopyKind) override {
    return hit("copyAsync");
  }
  void beginCapture() override { hit("beginCapture"); }
  void endCapture() override { hit("endCapture"); }
  bool capturing() const override { return true; }

  CommHandlePtr hit(const std::string& seam) {
    ++calls[seam];
    last = std::make_shared<Handle>();
    return last;
  }
  std::map<std::string, int> calls;
  CommHandlePtr last;
  CommHandlePtr after;
};

class Plain final : public ForwardingTransport {
 public:
  using ForwardingTransport::ForwardingTransport;
};

}  // namespace

TEST(ForwardingTransport, EverySeamReachesTheWrappedTransportWithItsArguments) {
  auto inner = std::make_shared<Counting>();
  Plain t(inner);
  EXPECT_EQ(t.rank(), 3);
  EXPECT_EQ(t.worldSize(), 4);
  EXPECT_EQ(t.backendName(), "counting");
  EXPECT_TRUE(t.capturing());
  const at::Tensor x = at::zeros({4});
  EXPECT_EQ(t.allGather(x, x), inner->last);
  EXPECT_EQ(t.allGatherCoalesced({x}, {x}), inner->last);
  EXPECT_EQ(t.reduceScatter(x, x.view({4, 1})), inner->last);
  EXPECT_EQ(t.allReduce(x), inner->last);
  EXPECT_EQ(t.gatherShards({x}, {x}), inner->last);
  EXPECT_EQ(t.newGatherBuffer(5, x.options()).numel(), 5);
  t.shardsWritten();
  t.reloadShard(x, x);
  const CommHandlePtr mark = t.markCaller();
  EXPECT_EQ(mark, inner->last);
  bool ran = false;
  t.runAfter(mark, [&] { ran = true; });
  EXPECT_TRUE(ran);
  EXPECT_EQ(inner->after, mark);
  EXPECT_EQ(t.copyAsync(x, x, Transport::CopyKind::Reload), inner->last);
  t.beginCapture();
  t.endCapture();
  for (const char* seam : {"allGather", "allGatherCoalesced", "reduceScatter", "allReduce", "gatherShards",
                           "newGatherBuffer", "shardsWritten", "reloadShard", "markCaller", "runAfter",
                           "copyAsync", "beginCapture", "endCapture"}) {
    EXPECT_EQ(inner->calls[seam], 1) << seam;
  }
}

TEST(ForwardingTransport, RefusesToWrapNothing) {
  try {
    Plain t(nullptr);
    FAIL() << "wrapped null";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("a transport decorator needs a transport to wrap"),
              std::string::npos);
  }
}
