// The base of Transport decorators: every seam of the interface forwarded to the wrapped one.
#pragma once

#include "dcplan/replayer/Transport.h"

#include <c10/util/Exception.h>

#include <memory>
#include <utility>

namespace dcplan::replayer {

/// Forwards every virtual of Transport to `inner`, so that a decorator (the collective check,
/// the recorder's timed transport) overrides only what it adds, and a seam added to Transport
/// is forwarded here, once, for all of them. (Each decorator used to forward by hand; the
/// recorder's missed runAfter and markCaller, and a recorded GPU run then ordered its gradient
/// accumulation unlike a replay.)
class ForwardingTransport : public Transport {
 public:
  explicit ForwardingTransport(std::shared_ptr<Transport> inner) : inner_(std::move(inner)) {
    TORCH_CHECK(inner_ != nullptr, "a transport decorator needs a transport to wrap, got null");
  }

  int rank() const override { return inner_->rank(); }
  int worldSize() const override { return inner_->worldSize(); }
  std::string backendName() const override { return inner_->backendName(); }
  CommHandlePtr allGather(const at::Tensor& output, const at::Tensor& input) override {
    return inner_->allGather(output, input);
  }
  CommHandlePtr allGatherCoalesced(const std::vector<at::Tensor>& outputs,
                                   const std::vector<at::Tensor>& inputs) override {
    return inner_->allGatherCoalesced(outputs, inputs);
  }
  CommHandlePtr reduceScatter(const at::Tensor& output, const at::Tensor& input) override {
    return inner_->reduceScatter(output, input);
  }
  CommHandlePtr allReduce(const at::Tensor& tensor) override { return inner_->allReduce(tensor); }
  CommHandlePtr gatherShards(const std::vector<at::Tensor>& outputs,
                             const std::vector<at::Tensor>& shards) override {
    return inner_->gatherShards(outputs, shards);
  }
  at::Tensor newGatherBuffer(int64_t numel, const at::TensorOptions& options) override {
    return inner_->newGatherBuffer(numel, options);
  }
  void shardsWritten() override { inner_->shardsWritten(); }
  void reloadShard(const at::Tensor& shard, const at::Tensor& host) override {
    inner_->reloadShard(shard, host);
  }
  CommHandlePtr markCaller() override { return inner_->markCaller(); }
  CommHandlePtr runAfter(const CommHandlePtr& done, const std::function<void()>& work) override {
    return inner_->runAfter(done, work);
  }
  CommHandlePtr copyAsync(const at::Tensor& dst, const at::Tensor& src, CopyKind kind) override {
    return inner_->copyAsync(dst, src, kind);
  }
  void beginCapture() override { inner_->beginCapture(); }
  void endCapture() override { inner_->endCapture(); }
  bool capturing() const override { return inner_->capturing(); }

 protected:
  Transport& inner() const { return *inner_; }

 private:
  std::shared_ptr<Transport> inner_;
};

}  // namespace dcplan::replayer
