// CPU kernels of the dc ops: thin forwarders to the runtime, whose transport is a c10d ProcessGroup (Gloo).
#include "dcplan/replayer/Runtime.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace dcplan::replayer {
namespace {

at::Tensor allgather_param_cpu(const at::Tensor& a, int64_t graphId, int64_t id,
                               std::optional<at::ScalarType> dtype) {
  return allgatherParam(a, graphId, id, dtype);
}

void prefetch_params_fused_cpu(int64_t graphId, const std::vector<at::Tensor>& params,
                               const std::vector<int64_t>& ids,
                               const std::optional<std::vector<at::ScalarType>>& dtypes) {
  prefetchParamsFused(graphId, params, ids, dtypes);
}

// The Tensor(a) ops return an alias (a new view), never the input itself.
at::Tensor wait_allgather_cpu(const at::Tensor& a, int64_t graphId, int64_t id) {
  return waitAllgather(a, graphId, id).alias();
}

at::Tensor release_param_cpu(const at::Tensor& a, int64_t graphId, int64_t id, int64_t nUsers) {
  return releaseParam(a, graphId, id, nUsers).alias();
}

at::Tensor reduce_grad_cpu(const at::Tensor& a, int64_t graphId, int64_t id) {
  return reduceGrad(a, graphId, id);
}

void free_tensors_cpu(const std::vector<at::Tensor>& a) { freeTensors(a); }

at::Tensor offload_tensor_cpu(const at::Tensor& a, int64_t graphId, int64_t id) {
  return offloadTensor(a, graphId, id);
}

at::Tensor reload_tensor_cpu(const at::Tensor& a, int64_t graphId, int64_t id) {
  return reloadTensor(a, graphId, id);
}

at::Tensor wait_offload_cpu(const at::Tensor& a, int64_t graphId, int64_t id) {
  return waitOffload(a, graphId, id);
}

at::Tensor wait_reload_cpu(const at::Tensor& a, int64_t graphId, int64_t id) {
  return waitReload(a, graphId, id);
}

void offload_parameter_cpu(const at::Tensor& a, int64_t graphId, int64_t id) {
  offloadParameter(a, graphId, id);
}

void reload_parameter_cpu(const at::Tensor& a, int64_t graphId, int64_t id) {
  reloadParameter(a, graphId, id);
}

void end_backward_cpu(int64_t graphId) { endBackward(graphId); }

// The reference implementation uses a shared-memory all-reduce between the
// ranks of one host. This one goes through the process group's allreduce
// (Gloo): the same result, without the SHM fast path.
at::Tensor inference_all_reduce_cpu(const at::Tensor& self) {
  TORCH_CHECK(self.device().is_cpu(), "inference_all_reduce: self should be a CPU tensor, got ",
              self.device());
  at::Tensor out = self.clone(at::MemoryFormat::Contiguous);
  allReduceInPlace("inference_all_reduce", out);
  return out;
}

at::Tensor& inference_all_reduce__cpu(at::Tensor& self) {
  TORCH_CHECK(self.device().is_cpu(), "inference_all_reduce_: self should be a CPU tensor, got ",
              self.device());
  allReduceInPlace("inference_all_reduce_", self);
  return self;
}

}  // namespace

TORCH_LIBRARY_IMPL(dc, CPU, m) {
  m.impl("allgather_param", &allgather_param_cpu);
  m.impl("prefetch_params_fused", &prefetch_params_fused_cpu);
  m.impl("wait_allgather", &wait_allgather_cpu);
  m.impl("release_param", &release_param_cpu);
  m.impl("reduce_grad", &reduce_grad_cpu);
  m.impl("free_tensors", &free_tensors_cpu);
  m.impl("offload_tensor", &offload_tensor_cpu);
  m.impl("reload_tensor", &reload_tensor_cpu);
  m.impl("wait_offload", &wait_offload_cpu);
  m.impl("wait_reload", &wait_reload_cpu);
  m.impl("offload_parameter", &offload_parameter_cpu);
  m.impl("reload_parameter", &reload_parameter_cpu);
  m.impl("end_backward", &end_backward_cpu);
  m.impl("inference_all_reduce", &inference_all_reduce_cpu);
  m.impl("inference_all_reduce_", &inference_all_reduce__cpu);
}

// end_backward has no tensor argument, so the dispatcher finds no backend key
// and dispatches to Undefined. Its work is the executor's, whatever the device.
TORCH_LIBRARY_IMPL(dc, Undefined, m) { m.impl("end_backward", &end_backward_cpu); }

}  // namespace dcplan::replayer
