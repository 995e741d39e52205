// Tensor memory helpers of the runtime: a tensor's bytes, and freeing and restoring its storage.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <cstdlib>

namespace dcplan::replayer {

/// Frees a tensor's storage (its memory goes back to the allocator) while
/// keeping the tensor object; restoreStorage gives it memory back.
inline void freeStorage(const at::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

inline void restoreStorage(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  c10::Allocator* allocator = impl->allocator();
  TORCH_INTERNAL_ASSERT(allocator != nullptr, "storage without allocator cannot be restored");
  impl->set_data_ptr_noswap(allocator->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

/// A host tensor like t, where offloaded data waits: pinned for a GPU tensor; for a CPU tensor
/// (CPU ranks) memory from outside torch's CPU allocator, so that it does not count as the
/// device's memory there (as a GPU's host memory does not).
inline at::Tensor hostBuffer(const at::Tensor& t) {
  if (!t.device().is_cpu()) return at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  void* data = std::malloc(bytes > 0 ? bytes : 1);
  TORCH_CHECK(data != nullptr, "out of host memory for a ", bytes, "-byte offload buffer");
  return at::from_blob(data, t.sizes(), [](void* d) { std::free(d); }, t.options());
}

inline int64_t tensorBytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

}  // namespace dcplan::replayer
