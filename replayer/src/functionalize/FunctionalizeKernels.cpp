// Functionalize kernel of inference_all_reduce_: the in-place op as out-of-place plus a replace.
#include <ATen/FunctionalTensorWrapper.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace dcplan::replayer {
namespace {

at::Tensor& inference_all_reduce__functionalize(at::Tensor& self) {
  TORCH_INTERNAL_ASSERT(at::functionalization::impl::isFunctionalTensor(self));
  at::functionalization::impl::sync(self);
  at::Tensor unwrapped = at::functionalization::impl::from_functional_tensor(self);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dc::inference_all_reduce", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  at::Tensor result;
  {
    at::AutoDispatchSkipFunctionalize guard;
    result = op.call(unwrapped);
  }
  at::functionalization::impl::replace_(self, result);
  at::functionalization::impl::commit_update(self);
  at::functionalization::impl::sync(self);
  return self;
}

}  // namespace

TORCH_LIBRARY_IMPL(dc, Functionalize, m) {
  m.impl("inference_all_reduce_", &inference_all_reduce__functionalize);
}

}  // namespace dcplan::replayer
