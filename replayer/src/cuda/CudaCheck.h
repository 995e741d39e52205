// Error macros of the CUDA/NCCL path: every CUDA runtime and NCCL call goes through one of them.
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

/// Throws a c10::Error naming the call, file:line and CUDA's message unless expr returns cudaSuccess.
#define DCPLAN_CUDA_CHECK(expr)                                                                    \
  do {                                                                                             \
    const cudaError_t dcplanErr_ = (expr);                                                         \
    TORCH_CHECK(dcplanErr_ == cudaSuccess, "CUDA error at ", __FILE__, ":", __LINE__, ": ", #expr, \
                " failed: ", cudaGetErrorName(dcplanErr_), ": ", cudaGetErrorString(dcplanErr_));  \
  } while (0)

/// Throws a c10::Error naming the call, file:line, NCCL's message and the communicator's last
/// error (comm may be nullptr) unless expr returns ncclSuccess.
#define DCPLAN_NCCL_CHECK_COMM(expr, comm)                                                         \
  do {                                                                                             \
    const ncclResult_t dcplanRes_ = (expr);                                                        \
    TORCH_CHECK(dcplanRes_ == ncclSuccess, "NCCL error at ", __FILE__, ":", __LINE__, ": ", #expr, \
                " failed: ", ncclGetErrorString(dcplanRes_), " (", ncclGetLastError(comm), ")");   \
  } while (0)

#define DCPLAN_NCCL_CHECK(expr) DCPLAN_NCCL_CHECK_COMM(expr, nullptr)
