// The ZeRO-1/2/3 executors: gathering and releasing a graph's parameters, reducing its gradients.
#include "RuntimeState.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <functional>
#include <utility>

namespace dcplan::replayer {

Executor::Executor(int64_t graphId, Stage stage, std::vector<int64_t> dsIds,
                   std::optional<at::ScalarType> reduceDtype, RuntimeState& rt)
    : graphId_(graphId), stage_(stage), dsIds_(std::move(dsIds)), reduceDtype_(reduceDtype), rt_(rt) {
  for (int64_t id : dsIds_) {
    rt_.registry_->get("register_graph", id);  // fails for unknown ids
    TORCH_CHECK(!inGraph_.count(id), "register_graph: graph_id ", graphId, " lists ds_id ", id, " twice");
    inGraph_[id] = true;
  }
  buckets_ = std::make_unique<DoubleBufferedReduceBucket>(
      rt_.transport_->worldSize(), /*rankMajor=*/stage != Stage::Zero1, rt_.config_.reduceBucketBytes,
      rt_.config_.doubleBuffer);
}

Param& Executor::param(const char* op, int64_t dsId) {
  Param& p = rt_.registry_->get(op, dsId);
  TORCH_CHECK(inGraph_.count(dsId), op, ": ", p.label(), " is not a parameter of graph_id ", graphId_);
  return p;
}

at::Tensor Executor::allgatherParam(const at::Tensor& shard, int64_t dsId,
                                    std::optional<at::ScalarType> dtype) {
  Param& p = param("allgather_param", dsId);
  TORCH_CHECK(shard.numel() == p.shardNumel_ || p.offloaded_, "allgather_param: ", p.label(),
              ": the tensor should be the registered shard of ", p.shardNumel_, " elements, got ",
              shard.numel());
  const at::ScalarType gatherType = dtype.value_or(p.shard_.scalar_type());
  std::vector<int64_t> ahead = rt_.schedule_->prefetchBefore(OpEvent{
      "allgather_param", graphId_, dsId, p.numel_ * int64_t(c10::elementSize(gatherType)), gatherType});
  if (!ahead.empty()) {
    prefetchParamsFused(ahead, std::vector<at::ScalarType>(ahead.size(), gatherType));
  }
  rt_.registry_->startGather(p, gatherType, *rt_.transport_);
  return p.gathered_;
}

void Executor::prefetchParamsFused(const std::vector<int64_t>& dsIds,
                                   const std::vector<at::ScalarType>& dtypes) {
  std::vector<Param*> ps;
  ps.reserve(dsIds.size());
  for (int64_t id : dsIds) ps.push_back(&param("prefetch_params_fused", id));
  rt_.registry_->startGatherFused(ps, dtypes, *rt_.transport_);
}

at::Tensor Executor::waitAllgather(const at::Tensor& gathered, int64_t dsId) {
  Param& p = param("wait_allgather", dsId);
  TORCH_CHECK(p.hasGathered(), "wait_allgather: ", p.label(),
              " has no gather in flight or held; call allgather_param first");
  rt_.registry_->waitGather(p);
  return gathered;
}

void Executor::releaseParam(int64_t dsId, int64_t nUsers) {
  Param& p = param("release_param", dsId);
  TORCH_CHECK(nUsers >= 1, "release_param: n_users should be >= 1, got ", nUsers, " for ", p.label());
  if (++p.uses_ < nUsers) return;
  p.uses_ = 0;
  bool keep =
      !rt_.profiling_ && rt_.schedule_->keepGathered(dsId, p.persistent_, keepsAllGathered(), p.trainable());
  // ZeRO-1/2 keep every copy by their stage: only a copy the plan keeps is the budget guard's to drop.
  if (keep && !keepsAllGathered() && guardDropsKept(rt_, graphId_, p)) keep = false;
  if (!keep) rt_.registry_->dropGathered(p);
}

void Executor::reduceGrad(const at::Tensor& grad, int64_t dsId) {
  Param& p = param("reduce_grad", dsId);
  TORCH_CHECK(p.trainable(), "reduce_grad: ", p.label(),
              " was registered without a gradient buffer (frozen); it takes no gradient");
  TORCH_CHECK(grad.numel() == p.numel_, "reduce_grad: ", p.label(), ": gradient should have shape ",
              shapeString(p.shape_), " (", p.numel_, " elements), got ", grad.sizes());
  addGrad(p, grad.reshape({-1}));
}

void Executor::addGrad(Param& p, const at::Tensor& gradFlat) { putInBucket(p, gradFlat); }

void Executor::putInBucket(Param& p, const at::Tensor& gradFlat) {
  const at::ScalarType dtype = reduceDtype_.value_or(gradFlat.scalar_type());
  const int ws = rt_.transport_->worldSize();
  const int64_t nextBytes = ws * p.shardNumel_ * int64_t(c10::elementSize(dtype));
  ReduceBucket* bucket = &buckets_->current(dtype, gradFlat.device());
  if (rt_.schedule_->flushBefore(graphId_, bucket->usedBytes(), nextBytes, rt_.config_.reduceBucketBytes)) {
    flush(dtype);
    bucket = &buckets_->current(dtype);
  }
  if (bucket->rankMajor()) {
    bucket->defer(p.id_, p.shardNumel_, gradFlat);
  } else {
    // A planned bucket is allocated at its size (the planner's memory model), not the capacity.
    int64_t sizeCols = 0;
    if (bucket->empty()) {
      if (const std::vector<int64_t>* ids = rt_.schedule_->plannedBucket(graphId_, p.id_)) {
        for (int64_t id : *ids) sizeCols += rt_.registry_->get("reduce_grad", id).shardNumel_;
      }
    }
    at::Tensor region = bucket->allocate(p.id_, p.shardNumel_, sizeCols);  // [ws, shardNumel]
    // Row r gets elements [r*s, (r+1)*s) of the gradient; the tail past numel is
    // zero, so no collective reads past the gradient.
    const int64_t s = p.shardNumel_;
    const int64_t fullRows = s == 0 ? 0 : p.numel_ / s;
    const int64_t rem = p.numel_ - fullRows * s;
    if (fullRows > 0)
      region.narrow(0, 0, fullRows).copy_(gradFlat.narrow(0, 0, fullRows * s).view({fullRows, s}));
    if (fullRows < ws) {
      at::Tensor row = region.select(0, fullRows);
      if (rem > 0) row.narrow(0, 0, rem).copy_(gradFlat.narrow(0, fullRows * s, rem));
      row.narrow(0, rem, s - rem).zero_();
      if (fullRows + 1 < ws) region.narrow(0, fullRows + 1, ws - fullRows - 1).zero_();
    }
  }
  if (rt_.schedule_->flushAfter(graphId_, p.id_)) flush(dtype);
}

void Executor::flush(at::ScalarType dtype) {
  ReduceBucket& bucket = buckets_->current(dtype);
  if (bucket.empty()) return;
  std::vector<int64_t> ids;
  for (const ReduceTask& task : bucket.tasks()) ids.push_back(task.dsId_);
  rt_.schedule_->onFlush(graphId_, ids, bucket.usedBytes());
  bucket.pending_ = launchReduce(bucket);
  ReduceBucket& next = buckets_->swap(dtype);
  // With double buffering the next bucket's reduction has had a whole bucket's
  // worth of backward to finish; without, this completes the one just launched.
  complete(next);
}

void Executor::complete(ReduceBucket& bucket) {
  if (!bucket.pending_) {
    TORCH_INTERNAL_ASSERT(bucket.empty(), "a filled bucket was not flushed");
    return;
  }
  const double scale = 1.0 / rt_.transport_->worldSize();  // gradients are averaged over ranks
  // Where each reduced slice goes is decided here, on the host; the tensor ops go in one
  // multi-tensor launch per kind (a bucket holds tens of gradients).
  std::vector<at::Tensor> copyTo, copyFrom, scaleOnly;
  // A gradient reduced twice into one bucket (a module called twice) is added to twice: one
  // multi-tensor launch must not write a tensor twice (its chunks run in parallel), so the
  // second addition goes into the next round.
  std::vector<std::vector<at::Tensor>> addTo, addFrom;
  auto addRound = [&](const at::Tensor& target) {
    size_t r = 0;
    while (r < addTo.size() && std::any_of(addTo[r].begin(), addTo[r].end(),
                                           [&](const at::Tensor& t) { return t.is_same(target); })) {
      ++r;
    }
    if (r == addTo.size()) {
      addTo.emplace_back();
      addFrom.emplace_back();
    }
    return r;
  };
  for (const ReduceTask& task : bucket.tasks()) {
    Param& p = rt_.registry_->get("end_backward", task.dsId_);
    at::Tensor reduced = reducedSlice(bucket, task);
    if (p.grad_.defined() && p.accumulate_) {
      const size_t r = addRound(p.grad_);
      addTo[r].push_back(p.grad_);
      addFrom[r].push_back(reduced);
    } else if (p.grad_.defined()) {
      copyTo.push_back(p.grad_);
      copyFrom.push_back(reduced);
    } else if (sliceIsGradient() && reduced.scalar_type() == p.shard_.scalar_type()) {
      p.grad_ = reduced;  // the reduced memory itself becomes the gradient
      scaleOnly.push_back(reduced);
    } else {
      p.grad_ = at::empty_like(p.shard_);  // on the caller's stream; runAfter orders after it
      copyTo.push_back(p.grad_);
      copyFrom.push_back(reduced);
    }
    p.accumulate_ = true;
  }
  // Queued after the reduction (on its stream on a GPU); end_backward waits for all of them.
  // At one rank the mean is the sum: no pass over the gradients to scale them by 1.
  const bool scales = scale != 1.0;
  CommHandlePtr accumulated = rt_.transport_->runAfter(bucket.pending_, [&] {
    if (!copyTo.empty()) {
      at::_foreach_copy_(copyTo, copyFrom);
      if (scales) at::_foreach_mul_(copyTo, scale);
    }
    if (scales && !scaleOnly.empty()) at::_foreach_mul_(scaleOnly, scale);
    for (size_t r = 0; r < addTo.size(); ++r) at::_foreach_add_(addTo[r], addFrom[r], scale);
  });
  bucket.reset();
  // While the reduction or the accumulation (ZeRO-1 reads the all-reduced buffer itself) may
  // still read the buffer (on a GPU), the next fill gets a fresh one; the allocator keeps this
  // memory until their stream is done with it.
  // A rank-major bucket packs a buffer of just its size at every flush; a planned flat bucket
  // was allocated at its own size, which the next one may not share.
  if (bucket.rankMajor() || bucket.plannedSize() || !accumulated->isCompleted()) bucket.releaseMemory();
  accumulations_.push_back(std::move(accumulated));
}

void Executor::startBackward(bool sync) { sync_ = sync; }

void Executor::endBackward() {
  for (ReduceBucket* b : buckets_->all()) {
    if (!b->empty() && !b->pending_) flush(b->dtype());
  }
  drain();
  // Bucket memory is for backward only: the optimizer step and the next forward peak without it.
  for (ReduceBucket* b : buckets_->all()) b->releaseMemory();
}

void Executor::drain() {
  for (ReduceBucket* b : buckets_->all()) complete(*b);
  for (const CommHandlePtr& h : accumulations_) h->wait();
  accumulations_.clear();
}

void Zero1Executor::addGrad(Param& p, const at::Tensor& gradFlat) {
  auto it = localGrad_.find(p.id_);
  if (!sync_) {
    if (it == localGrad_.end()) {
      localGrad_.emplace(p.id_, gradFlat.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true));
    } else {
      it->second.add_(gradFlat);
    }
    return;
  }
  if (it == localGrad_.end()) {
    putInBucket(p, gradFlat);
    return;
  }
  at::Tensor total = std::move(it->second);
  localGrad_.erase(it);
  total.add_(gradFlat);
  putInBucket(p, total);
}

CommHandlePtr Zero1Executor::launchReduce(ReduceBucket& bucket) {
  return rt_.transport_->allReduce(bucket.commInput());
}

at::Tensor Zero1Executor::reducedSlice(ReduceBucket& bucket, const ReduceTask& task) {
  return bucket.region(task).select(0, rt_.transport_->rank());
}

CommHandlePtr ShardedGradExecutor::launchReduce(ReduceBucket& bucket) {
  bucket.pack();
  at::Tensor input = bucket.commInput();
  // At one rank the reduction is the identity: the packed bucket is its own output, reduced in
  // place, which a transport returns at once (reducesAloneInPlace; the recorder still sees the
  // bucket's call). The planner's RuntimeMemory::packsIntoOutput and CostModel::us.
  bucket.output_ = rt_.transport_->worldSize() == 1 ? input.reshape({-1})
                                                    : at::empty({input.size(1)}, input.options());
  return rt_.transport_->reduceScatter(bucket.output_, input);
}

at::Tensor ShardedGradExecutor::reducedSlice(ReduceBucket& bucket, const ReduceTask& task) {
  return bucket.output_.narrow(0, task.colOffset_, task.cols_);
}

}  // namespace dcplan::replayer
