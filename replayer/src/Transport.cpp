// The defaults of the Transport interface.
#include "dcplan/replayer/Transport.h"

#include <ATen/ATen.h>

namespace dcplan::replayer {
namespace {

/// A handle of work that finished before it was returned.
class DoneHandle final : public CommHandle {
 public:
  void wait() override {}
  bool isCompleted() override { return true; }
};

}  // namespace

std::string failureMessage(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error ? error->what_without_backtrace() : e.what();
}

CommHandlePtr Transport::gatherShards(const std::vector<at::Tensor>& outputs,
                                      const std::vector<at::Tensor>& shards) {
  TORCH_CHECK(outputs.size() == shards.size(), "gatherShards: ", outputs.size(), " outputs for ",
              shards.size(), " shards");
  std::vector<at::Tensor> inputs;
  inputs.reserve(shards.size());
  for (size_t i = 0; i < shards.size(); ++i)
    inputs.push_back(shards[i].to(outputs[i].scalar_type()).contiguous());
  if (inputs.size() == 1) return allGather(outputs[0], inputs[0]);
  return allGatherCoalesced(outputs, inputs);
}

void Transport::reloadShard(const at::Tensor& shard, const at::Tensor& host) {
  shard.copy_(host, /*non_blocking=*/host.is_pinned());
  shardsWritten();
}

CommHandlePtr doneHandle() { return std::make_shared<DoneHandle>(); }

bool reducesAloneInPlace(const at::Tensor& output, const at::Tensor& input) {
  return input.dim() == 2 && input.size(0) == 1 && output.data_ptr() == input.data_ptr();
}

CommHandlePtr Transport::markCaller() { return doneHandle(); }

CommHandlePtr Transport::runAfter(const CommHandlePtr& done, const std::function<void()>& work) {
  done->wait();
  work();
  return doneHandle();
}

at::Tensor Transport::newGatherBuffer(int64_t numel, const at::TensorOptions& options) {
  return at::empty({numel}, options);
}

CommHandlePtr Transport::copyAsync(const at::Tensor& dst, const at::Tensor& src, CopyKind kind) {
  TORCH_CHECK(dst.sizes() == src.sizes() && dst.scalar_type() == src.scalar_type(),
              kind == CopyKind::Offload ? "offload" : "reload", ": copy of ", src.sizes(), " ",
              src.scalar_type(), " into ", dst.sizes(), " ", dst.scalar_type());
  dst.copy_(src);
  return doneHandle();
}

void Transport::beginCapture() {
  TORCH_CHECK(false,
              "begin_capture: a CUDA graph captures only work queued on a GPU (the NCCL transport); this "
              "runtime uses the ",
              backendName(), " transport");
}

}  // namespace dcplan::replayer
