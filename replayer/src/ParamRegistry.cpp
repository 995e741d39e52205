// The parameter registry: shards, gathered copies (and how many may lag behind the device), offload.
#include "Executor.h"
#include "TensorMemory.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace dcplan::replayer {

void ParamRegistry::registerParam(int64_t dsId, const std::vector<int64_t>& shape, const at::Tensor& shard,
                                  const at::Tensor& gradBuffer, bool persistent, bool trainable,
                                  const std::string& name) {
  TORCH_CHECK(dsId >= 0, "register_param: ds_id should be >= 0, got ", dsId);
  TORCH_CHECK(!contains(dsId), "register_param: ds_id ", dsId, " is already registered");
  Param p;
  p.id_ = dsId;
  p.name_ = name;
  const std::string label = p.label();
  int64_t numel = 1;
  for (int64_t d : shape) {
    TORCH_CHECK(d >= 0, "register_param: ", label, ": shape should have dims >= 0, got ", shapeString(shape));
    numel *= d;
  }
  const int64_t shardNumel = shardNumelOf(numel, worldSize_);
  TORCH_CHECK(shard.defined() && shard.dim() == 1 && shard.is_contiguous(), "register_param: ", label,
              ": ds_tensor should be a contiguous 1-D tensor");
  TORCH_CHECK(shard.numel() == shardNumel, "register_param: ", label,
              ": ds_tensor should have ceil(numel/world_size) = ", shardNumel, " elements for shape ",
              shapeString(shape), " and world size ", worldSize_, ", got ", shard.numel());
  if (gradBuffer.defined()) {
    TORCH_CHECK(gradBuffer.dim() == 1 && gradBuffer.is_contiguous() && gradBuffer.numel() == shardNumel,
                "register_param: ", label, ": grad_buffer should be a contiguous 1-D tensor of ", shardNumel,
                " elements, got ", gradBuffer.sizes());
    TORCH_CHECK(gradBuffer.device() == shard.device(), "register_param: ", label,
                ": grad_buffer should be on ", shard.device(), ", got ", gradBuffer.device());
  }
  p.shape_ = shape;
  p.numel_ = numel;
  p.shardNumel_ = shardNumel;
  p.shard_ = shard;
  p.trainable_ = trainable || gradBuffer.defined();
  p.grad_ = gradBuffer;
  p.fixedGrad_ = gradBuffer.defined();
  p.persistent_ = persistent;
  params_.emplace(dsId, std::move(p));
}

Param& ParamRegistry::get(const char* op, int64_t dsId) {
  auto it = params_.find(dsId);
  TORCH_CHECK(it != params_.end(), op, ": ds_id ", dsId,
              " is not registered; register it with register_param first");
  return it->second;
}

void ParamRegistry::boundReleaseLag() {
  if (transport_.capturing()) return;
  while (!released_.empty() &&
         (releasedBytes_ > maxReleaseLagBytes_ || released_.front().first->isCompleted())) {
    released_.front().first->synchronize();
    releasedBytes_ -= released_.front().second;
    released_.pop_front();
  }
}

void ParamRegistry::startGather(Param& p, at::ScalarType dtype, Transport& transport) {
  if (p.hasGathered() && p.gathered_.scalar_type() == dtype) return;
  dropGathered(p);
  boundReleaseLag();
  reloadForGather(p, transport);
  const int64_t ws = worldSize_;
  p.gatheredBuffer_ = transport.newGatherBuffer(ws * p.shardNumel_, p.shard_.options().dtype(dtype));
  p.gathered_ = p.gatheredBuffer_.narrow(0, 0, p.numel_).view(p.shape_);
  p.gatherHandle_ = transport.gatherShards({p.gatheredBuffer_}, {p.shard_});
  p.valid_ = false;
}

void ParamRegistry::startGatherFused(const std::vector<Param*>& ps, const std::vector<at::ScalarType>& dtypes,
                                     Transport& transport) {
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> inputs;
  std::vector<Param*> launched;
  for (size_t i = 0; i < ps.size(); ++i) {
    Param& p = *ps[i];
    if (p.hasGathered() && p.gathered_.scalar_type() == dtypes[i]) continue;
    if (std::find(launched.begin(), launched.end(), &p) != launched.end()) continue;
    dropGathered(p);
    boundReleaseLag();
    reloadForGather(p, transport);
    p.gatheredBuffer_ =
        transport.newGatherBuffer(worldSize_ * p.shardNumel_, p.shard_.options().dtype(dtypes[i]));
    p.gathered_ = p.gatheredBuffer_.narrow(0, 0, p.numel_).view(p.shape_);
    p.valid_ = false;
    outputs.push_back(p.gatheredBuffer_);
    inputs.push_back(p.shard_);
    launched.push_back(&p);
  }
  if (launched.empty()) return;
  CommHandlePtr handle = transport.gatherShards(outputs, inputs);
  for (Param* p : launched) p->gatherHandle_ = handle;
}

void ParamRegistry::waitGather(Param& p) {
  if (p.gatherHandle_) {
    // A fused handle is shared; waiting on it twice is a no-op for the second.
    p.gatherHandle_->wait();
    p.gatherHandle_.reset();
  }
  if (p.hasGathered()) p.valid_ = true;
  // The gather has read the shard: a master kept on the host goes back there (the caller's
  // stream now follows the gather, so the block is reused only after it).
  if (p.masterOnHost_ && !p.offloaded_) offload(p, /*copyOut=*/false);
}

std::vector<at::Tensor> ParamRegistry::forgetGatheredOfGraph() {
  std::vector<at::Tensor> held;
  for (auto& [id, p] : params_) {
    if (p.gatheredBuffer_.defined()) held.push_back(p.gatheredBuffer_);
    if (p.gathered_.defined()) held.push_back(p.gathered_);
    p.gatherHandle_.reset();
    clearGathered(p);
  }
  forgetReleases();
  return held;
}

void ParamRegistry::clearGathered(Param& p) {
  p.gathered_ = at::Tensor();
  p.gatheredBuffer_ = at::Tensor();
  p.valid_ = false;
  p.uses_ = 0;
}

void ParamRegistry::dropAllGathered() {
  for (auto& [id, p] : params_) dropGathered(p);
}

void ParamRegistry::dropGathered(Param& p) {
  if (p.gatherHandle_) {
    p.gatherHandle_->wait();  // the buffer must outlive the collective writing it
    p.gatherHandle_.reset();
  }
  if (p.gatheredBuffer_.defined() && maxReleaseLagBytes_ >= 0 && !transport_.capturing()) {
    CommHandlePtr used = transport_.markCaller();
    if (!used->isCompleted()) {
      const int64_t bytes =
          p.gatheredBuffer_.numel() * static_cast<int64_t>(p.gatheredBuffer_.element_size());
      released_.emplace_back(std::move(used), bytes);
      releasedBytes_ += bytes;
    }
  }
  clearGathered(p);
}

void ParamRegistry::offload(Param& p, bool copyOut) {
  if (p.offloaded_) return;
  awaitReloadForGather(p);
  if (!p.host_.defined()) {
    TORCH_CHECK(copyOut, p.label(), ": its shard has no host copy to go back to");
    p.host_ = hostBuffer(p.shard_);
  }
  // Into pinned memory the copy is queued on the caller's stream, and the freed block is reused
  // only by later work on that stream; a reload for a gather waits for that work before it reads
  // host_ on the reload stream.
  if (copyOut) p.host_.copy_(p.shard_, /*non_blocking=*/p.host_.is_pinned());
  freeStorage(p.shard_);
  p.offloaded_ = true;
}

void ParamRegistry::reload(Param& p) {
  if (!p.offloaded_) {
    awaitReloadForGather(p);
    return;
  }
  restoreStorage(p.shard_, static_cast<size_t>(tensorBytes(p.shard_)));
  // From pinned memory the copy is queued on the caller's stream; host_ is written again only by
  // a copy out queued after it.
  p.shard_.copy_(p.host_, /*non_blocking=*/p.host_.is_pinned());
  p.offloaded_ = false;
}

void ParamRegistry::awaitReloadForGather(Param& p) {
  // A master brought back for a gather still in flight was written on the transport's reload
  // stream, which that gather waited for: waiting for the gather orders the caller after the copy.
  if (p.masterOnHost_ && p.gatherHandle_) p.gatherHandle_->wait();
}

void ParamRegistry::reloadForGather(Param& p, Transport& transport) {
  if (!p.offloaded_) return;
  restoreStorage(p.shard_, static_cast<size_t>(tensorBytes(p.shard_)));
  transport.reloadShard(p.shard_, p.host_);
  p.offloaded_ = false;
}

}  // namespace dcplan::replayer
