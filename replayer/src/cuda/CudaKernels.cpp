// CUDA kernels of the dc ops: thin forwarders to the runtime, whose transport is then the NCCL one
// (NcclTransport: its own communicator and streams). Each runs under a guard of its tensor's device.
#include "dcplan/replayer/Runtime.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace dcplan::replayer {
namespace {

at::Tensor allgather_param_cuda(const at::Tensor& a, int64_t graphId, int64_t id,
                                std::optional<at::ScalarType> dtype) {
  c10::cuda::CUDAGuard guard(a.device());
  return allgatherParam(a, graphId, id, dtype);
}

void prefetch_params_fused_cuda(int64_t graphId, const std::vector<at::Tensor>& params,
                                const std::vector<int64_t>& ids,
                                const std::optional<std::vector<at::ScalarType>>& dtypes) {
  c10::cuda::OptionalCUDAGuard guard;
  if (!params.empty()) guard.set_device(params.front().device());
  prefetchParamsFused(graphId, params, ids, dtypes);
}

// The Tensor(a) ops return an alias (a new view), never the input itself. wait_allgather
// makes the caller's stream wait for the gather; the host does not block.
at::Tensor wait_allgather_cuda(const at::Tensor& a, int64_t graphId, int64_t id) {
  c10::cuda::CUDAGuard guard(a.device());
  return waitAllgather(a, graphId, id).alias();
}

at::Tensor release_param_cuda(const at::Tensor& a, int64_t graphId, int64_t id, int64_t nUsers) {
  c10::cuda::CUDAGuard guard(a.device());
  return releaseParam(a, graphId, id, nUsers).alias();
}

at::Tensor reduce_grad_cuda(const at::Tensor& a, int64_t graphId, int64_t id) {
  c10::cuda::CUDAGuard guard(a.device());
  return reduceGrad(a, graphId, id);
}

void free_tensors_cuda(const std::vector<at::Tensor>& a) { freeTensors(a); }

at::Tensor offload_tensor_cuda(const at::Tensor& a, int64_t graphId, int64_t id) {
  c10::cuda::CUDAGuard guard(a.device());
  return offloadTensor(a, graphId, id);
}

at::Tensor reload_tensor_cuda(const at::Tensor& a, int64_t graphId, int64_t id) {
  c10::cuda::CUDAGuard guard(a.device());
  return reloadTensor(a, graphId, id);
}

at::Tensor wait_offload_cuda(const at::Tensor& a, int64_t graphId, int64_t id) {
  return waitOffload(a, graphId, id);
}

at::Tensor wait_reload_cuda(const at::Tensor& a, int64_t graphId, int64_t id) {
  c10::cuda::CUDAGuard guard(a.device());
  return waitReload(a, graphId, id);
}

void offload_parameter_cuda(const at::Tensor& a, int64_t graphId, int64_t id) {
  c10::cuda::CUDAGuard guard(a.device());
  offloadParameter(a, graphId, id);
}

void reload_parameter_cuda(const at::Tensor& a, int64_t graphId, int64_t id) {
  c10::cuda::CUDAGuard guard(a.device());
  reloadParameter(a, graphId, id);
}

// The reference's shared-memory fast path is CPU only; on GPUs the all-reduce is NCCL's.
at::Tensor inference_all_reduce_cuda(const at::Tensor& self) {
  c10::cuda::CUDAGuard guard(self.device());
  at::Tensor out = self.clone(at::MemoryFormat::Contiguous);
  allReduceInPlace("inference_all_reduce", out);
  return out;
}

at::Tensor& inference_all_reduce__cuda(at::Tensor& self) {
  c10::cuda::CUDAGuard guard(self.device());
  allReduceInPlace("inference_all_reduce_", self);
  return self;
}

}  // namespace

TORCH_LIBRARY_IMPL(dc, CUDA, m) {
  m.impl("allgather_param", &allgather_param_cuda);
  m.impl("prefetch_params_fused", &prefetch_params_fused_cuda);
  m.impl("wait_allgather", &wait_allgather_cuda);
  m.impl("release_param", &release_param_cuda);
  m.impl("reduce_grad", &reduce_grad_cuda);
  m.impl("free_tensors", &free_tensors_cuda);
  m.impl("offload_tensor", &offload_tensor_cuda);
  m.impl("reload_tensor", &reload_tensor_cuda);
  m.impl("wait_offload", &wait_offload_cuda);
  m.impl("wait_reload", &wait_reload_cuda);
  m.impl("offload_parameter", &offload_parameter_cuda);
  m.impl("reload_parameter", &reload_parameter_cuda);
  m.impl("inference_all_reduce", &inference_all_reduce_cuda);
  m.impl("inference_all_reduce_", &inference_all_reduce__cuda);
}

}  // namespace dcplan::replayer
