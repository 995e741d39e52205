// RAII owners of the CUDA/NCCL resources of the runtime: the communicator and the stream set.
#pragma once

#include "cuda/CudaCheck.h"

#include <c10/core/Device.h>
#include <c10/cuda/CUDAStream.h>

#include <array>
#include <memory>
#include <string>

namespace dcplan::replayer::cuda {

/// One NCCL communicator, destroyed with its owner. Non-copyable; made by create().
class NcclComm {
 public:
  /// Joins the communicator of uniqueId as rank of worldSize on device. Collective: every
  /// rank must call it with the same id.
  static std::unique_ptr<NcclComm> create(const ncclUniqueId& uniqueId, int rank, int worldSize,
                                          c10::DeviceIndex device);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  ncclComm_t get() const { return comm_; }
  /// ncclCommAbort: ends the communicator's kernels wherever they wait (the watchdog's last
  /// resort); the destructor then has nothing to destroy. Call it once.
  void abort();
  int rank() const { return rank_; }
  int worldSize() const { return worldSize_; }
  c10::DeviceIndex device() const { return device_; }

 private:
  NcclComm(ncclComm_t comm, int rank, int worldSize, c10::DeviceIndex device)
      : comm_(comm), rank_(rank), worldSize_(worldSize), device_(device) {}

  ncclComm_t comm_;
  bool aborted_ = false;
  int rank_;
  int worldSize_;
  c10::DeviceIndex device_;
};

/// The dedicated streams of the runtime on one device: all-gathers, reductions, offload and
/// reload copies (taken from torch's stream pool, high
/// priority, so that communication is not queued behind compute kernels).
class StreamSet {
 public:
  static std::unique_ptr<StreamSet> create(c10::DeviceIndex device);
  StreamSet(const StreamSet&) = delete;
  StreamSet& operator=(const StreamSet&) = delete;

  c10::cuda::CUDAStream allGather;
  c10::cuda::CUDAStream reduceScatter;
  c10::cuda::CUDAStream offload;
  c10::cuda::CUDAStream reload;

  std::array<c10::cuda::CUDAStream, 4> all() const { return {allGather, reduceScatter, offload, reload}; }

 private:
  explicit StreamSet(c10::DeviceIndex device);
};

/// A CUDA event without timing, destroyed with its owner. Non-copyable; made by create().
class CudaEvent {
 public:
  static std::unique_ptr<CudaEvent> create(c10::DeviceIndex device);
  ~CudaEvent();
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  void record(cudaStream_t stream);
  /// stream waits (on the device) for the work recorded so far.
  void block(cudaStream_t stream);
  bool query();
  /// The host waits for the work recorded so far.
  void synchronize();

 private:
  CudaEvent(cudaEvent_t event, c10::DeviceIndex device) : event_(event), device_(device) {}

  cudaEvent_t event_;
  c10::DeviceIndex device_;
};

/// A fresh NCCL unique id as 128 raw bytes (made by one rank, sent to the others).
std::string newUniqueId();

}  // namespace dcplan::replayer::cuda
