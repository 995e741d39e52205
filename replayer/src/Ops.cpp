// The dc op set: schemas only. Kernels live in one file per dispatch key.
#include <torch/library.h>

// The reference schemas name both ints of the offload/reload ops "id"; they
// are named graph_id and id here (same types and order), because duplicate
// argument names break Python signatures (torch.library.opcheck, kwargs).
TORCH_LIBRARY(dc, m) {
  m.def("allgather_param(Tensor a, int graph_id, int id, ScalarType? dtype = None) -> Tensor");
  m.def("prefetch_params_fused(int graph_id, Tensor[] params, int[] ids, ScalarType[]? dtypes = None) -> ()");
  m.def("wait_allgather(Tensor(a) a, int graph_id, int id) -> Tensor(a)");
  m.def("release_param(Tensor(a) a, int graph_id, int id, int n_users) -> Tensor(a)");
  m.def("reduce_grad(Tensor a, int graph_id, int id) -> Tensor");
  m.def("free_tensors(Tensor[] a) -> ()");
  m.def("offload_tensor(Tensor a, int graph_id, int id) -> Tensor");
  m.def("reload_tensor(Tensor a, int graph_id, int id) -> Tensor");
  m.def("wait_offload(Tensor a, int graph_id, int id) -> Tensor");
  m.def("wait_reload(Tensor a, int graph_id, int id) -> Tensor");
  m.def("offload_parameter(Tensor a, int graph_id, int id) -> ()");
  m.def("reload_parameter(Tensor a, int graph_id, int id) -> ()");
  m.def("end_backward(int graph_id) -> ()");
  m.def("inference_all_reduce(Tensor self) -> Tensor");
  m.def("inference_all_reduce_(Tensor(a!) self) -> Tensor(a!)");
}
