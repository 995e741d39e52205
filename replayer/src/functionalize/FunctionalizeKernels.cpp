// Functionalize kernels: inference_all_reduce_ as out-of-place plus a replace; the Tensor(a) ops as copies.
#include <ATen/FunctionalTensorWrapper.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <functional>

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

// wait_allgather and release_param return an alias of their input, which
// functionalization cannot express for a custom op. In a functional program
// they return a copy instead (the ops never mutate, so only aliasing is lost).
at::Tensor unwrapCallCopy(const at::Tensor& a, const std::function<at::Tensor(const at::Tensor&)>& call) {
  at::Tensor inner = a;
  if (at::functionalization::impl::isFunctionalTensor(a)) {
    at::functionalization::impl::sync(a);
    inner = at::functionalization::impl::from_functional_tensor(a);
  }
  at::Tensor out;
  {
    at::AutoDispatchSkipFunctionalize guard;
    out = call(inner).clone();
  }
  return at::functionalization::impl::to_functional_tensor(out);
}

at::Tensor wait_allgather_functionalize(const at::Tensor& a, int64_t graphId, int64_t id) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dc::wait_allgather", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t)>();
  return unwrapCallCopy(a, [&](const at::Tensor& t) { return op.call(t, graphId, id); });
}

at::Tensor release_param_functionalize(const at::Tensor& a, int64_t graphId, int64_t id, int64_t nUsers) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dc::release_param", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t)>();
  return unwrapCallCopy(a, [&](const at::Tensor& t) { return op.call(t, graphId, id, nUsers); });
}

}  // namespace

TORCH_LIBRARY_IMPL(dc, Functionalize, m) {
  m.impl("inference_all_reduce_", &inference_all_reduce__functionalize);
  m.impl("wait_allgather", &wait_allgather_functionalize);
  m.impl("release_param", &release_param_functionalize);
}

}  // namespace dcplan::replayer
