// Reduce buckets: the [world_size, cols] layout gradients are reduced in, single and double buffered.
#include "Executor.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace dcplan::replayer {

ReduceBucket::ReduceBucket(at::ScalarType dtype, c10::Device device, int worldSize, bool rankMajor,
                           int64_t capacityBytes)
    : dtype_(dtype), device_(device), worldSize_(worldSize), rankMajor_(rankMajor) {
  const int64_t elemBytes = static_cast<int64_t>(c10::elementSize(dtype));
  capacityCols_ = std::max<int64_t>(1, capacityBytes / (elemBytes * worldSize));
  configuredCols_ = capacityCols_;
}

void ReduceBucket::reserveCols(int64_t cols, int64_t sizeCols) {
  if (buffer_.defined() && usedCols_ + cols <= capacityCols_) return;
  if (!buffer_.defined() && sizeCols > 0) {  // a planned bucket's own size
    capacityCols_ = sizeCols;
    plannedSize_ = true;
  }
  const int64_t newCap = std::max(capacityCols_, usedCols_ + cols);
  at::Tensor fresh = at::empty({worldSize_ * newCap}, at::TensorOptions().dtype(dtype_).device(device_));
  if (buffer_.defined() && usedCols_ > 0) {
    if (rankMajor_) {
      fresh.view({worldSize_, newCap})
          .narrow(1, 0, usedCols_)
          .copy_(buffer_.view({worldSize_, capacityCols_}).narrow(1, 0, usedCols_));
    } else {
      fresh.narrow(0, 0, worldSize_ * usedCols_).copy_(buffer_.narrow(0, 0, worldSize_ * usedCols_));
    }
  }
  buffer_ = fresh;
  capacityCols_ = newCap;
}

at::Tensor ReduceBucket::allocate(int64_t dsId, int64_t cols, int64_t sizeCols) {
  TORCH_INTERNAL_ASSERT(pending_ == nullptr, "filling a bucket whose reduction is in flight");
  reserveCols(cols, sizeCols);
  tasks_.push_back(ReduceTask{dsId, usedCols_, cols});
  usedCols_ += cols;
  return region(tasks_.back());
}

void ReduceBucket::defer(int64_t dsId, int64_t cols, const at::Tensor& gradFlat) {
  TORCH_INTERNAL_ASSERT(pending_ == nullptr, "filling a bucket whose reduction is in flight");
  TORCH_INTERNAL_ASSERT(rankMajor_ && !buffer_.defined(), "defer() fills a packed or flat bucket");
  tasks_.push_back(ReduceTask{dsId, usedCols_, cols});
  usedCols_ += cols;
  if (cols > 0) deferred_.push_back(gradFlat);
}

void ReduceBucket::pack() {
  if (buffer_.defined()) return;
  buffer_ = at::empty({worldSize_ * usedCols_}, at::TensorOptions().dtype(dtype_).device(device_));
  capacityCols_ = usedCols_;
  if (!deferred_.empty()) {
    at::Tensor out = buffer_.view({worldSize_, usedCols_});
    at::_chunk_cat_out(out, deferred_, 0, worldSize_);
  }
  deferred_.clear();
}

at::Tensor ReduceBucket::region(const ReduceTask& task) const {
  if (rankMajor_) {
    return buffer_.view({worldSize_, capacityCols_}).narrow(1, task.colOffset_, task.cols_);
  }
  return buffer_.narrow(0, worldSize_ * task.colOffset_, worldSize_ * task.cols_)
      .view({worldSize_, task.cols_});
}

at::Tensor ReduceBucket::commInput() const {
  if (rankMajor_) return buffer_.view({worldSize_, capacityCols_}).narrow(1, 0, usedCols_);
  return buffer_.narrow(0, 0, worldSize_ * usedCols_);
}

int64_t ReduceBucket::usedBytes() const {
  return worldSize_ * usedCols_ * static_cast<int64_t>(c10::elementSize(dtype_));
}

void ReduceBucket::releaseMemory() {
  TORCH_INTERNAL_ASSERT(empty() && !pending_, "releasing a bucket that holds gradients");
  buffer_ = at::Tensor();
  capacityCols_ = configuredCols_;
  plannedSize_ = false;
}

void ReduceBucket::reset() {
  tasks_.clear();
  deferred_.clear();
  usedCols_ = 0;
  pending_.reset();
  output_ = at::Tensor();
}

ReduceBucket& DoubleBufferedReduceBucket::current(at::ScalarType dtype, c10::Device device) {
  Pair& p = pair(dtype, device);
  return *p.buckets[p.current];
}

ReduceBucket& DoubleBufferedReduceBucket::swap(at::ScalarType dtype) {
  Pair& p = pair(dtype);
  if (doubleBuffer_) p.current = 1 - p.current;
  return *p.buckets[p.current];
}

std::vector<ReduceBucket*> DoubleBufferedReduceBucket::all() {
  std::vector<ReduceBucket*> out;
  for (auto& [dtype, p] : pairs_) {
    // The non-current bucket was flushed first, so complete it first.
    out.push_back(p.buckets[1 - p.current].get());
    out.push_back(p.buckets[p.current].get());
  }
  return out;
}

DoubleBufferedReduceBucket::Pair& DoubleBufferedReduceBucket::pair(at::ScalarType dtype, c10::Device device) {
  auto it = pairs_.find(dtype);
  if (it != pairs_.end()) return it->second;
  Pair p;
  for (auto& b : p.buckets) {
    b = std::make_unique<ReduceBucket>(dtype, device, worldSize_, rankMajor_, capacityBytes_);
  }
  return pairs_.emplace(dtype, std::move(p)).first->second;
}

}  // namespace dcplan::replayer
