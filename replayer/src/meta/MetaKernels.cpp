// Meta kernels of the dc ops: shapes and dtypes only, no communication.
#include "dcplan/replayer/Runtime.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace dcplan::replayer {
namespace {

at::Tensor allgather_param_meta(const at::Tensor& a, int64_t graphId, int64_t id,
                                std::optional<at::ScalarType> dtype) {
  return at::empty(paramShape("allgather_param", id), a.options().dtype(dtype.value_or(a.scalar_type())));
}

void prefetch_params_fused_meta(int64_t, const std::vector<at::Tensor>&, const std::vector<int64_t>&,
                                const std::optional<std::vector<at::ScalarType>>&) {}

at::Tensor wait_allgather_meta(const at::Tensor& a, int64_t, int64_t) { return a.alias(); }

at::Tensor release_param_meta(const at::Tensor& a, int64_t, int64_t, int64_t) { return a.alias(); }

at::Tensor reduce_grad_meta(const at::Tensor& a, int64_t, int64_t) { return at::empty({0}, a.options()); }

void free_tensors_meta(const std::vector<at::Tensor>&) {}

// The offload/reload copies keep shape, dtype and layout.
at::Tensor offload_tensor_meta(const at::Tensor& a, int64_t, int64_t) { return at::empty_like(a); }
at::Tensor reload_tensor_meta(const at::Tensor& a, int64_t, int64_t) { return at::empty_like(a); }
at::Tensor wait_offload_meta(const at::Tensor& a, int64_t, int64_t) { return at::empty_like(a); }
at::Tensor wait_reload_meta(const at::Tensor& a, int64_t, int64_t) { return at::empty_like(a); }

void offload_parameter_meta(const at::Tensor&, int64_t, int64_t) {}
void reload_parameter_meta(const at::Tensor&, int64_t, int64_t) {}

void end_backward_meta(int64_t) {}

at::Tensor inference_all_reduce_meta(const at::Tensor& self) {
  return at::empty_like(self, at::MemoryFormat::Contiguous);
}

at::Tensor& inference_all_reduce__meta(at::Tensor& self) { return self; }

}  // namespace

TORCH_LIBRARY_IMPL(dc, Meta, m) {
  m.impl("allgather_param", &allgather_param_meta);
  m.impl("prefetch_params_fused", &prefetch_params_fused_meta);
  m.impl("wait_allgather", &wait_allgather_meta);
  m.impl("release_param", &release_param_meta);
  m.impl("reduce_grad", &reduce_grad_meta);
  m.impl("free_tensors", &free_tensors_meta);
  m.impl("offload_tensor", &offload_tensor_meta);
  m.impl("reload_tensor", &reload_tensor_meta);
  m.impl("wait_offload", &wait_offload_meta);
  m.impl("wait_reload", &wait_reload_meta);
  m.impl("offload_parameter", &offload_parameter_meta);
  m.impl("reload_parameter", &reload_parameter_meta);
  m.impl("end_backward", &end_backward_meta);
  m.impl("inference_all_reduce", &inference_all_reduce_meta);
  m.impl("inference_all_reduce_", &inference_all_reduce__meta);
}

}  // namespace dcplan::replayer
