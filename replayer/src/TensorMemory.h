// Tensor memory helpers of the runtime: a tensor's bytes, and freeing and restoring its storage.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

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

inline int64_t tensorBytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

}  // namespace dcplan::replayer
