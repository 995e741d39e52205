// queueDeviceSleep on CUDA: torch's spin kernel, sized by the device's rated SM clock.
#include "dcplan/replayer/DeviceSleep.h"

#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cmath>

#include "cuda/CudaCheck.h"

namespace dcplan::replayer {

namespace {

/// The device's rated SM clock in kHz, asked once per device: the device-lead step queues busy
/// work before every op, and the attribute query was most of that step's host time (py-spy on
/// 1xH200, 2026-11-28), where a launch is a few microseconds.
int clockKiloHertz(c10::DeviceIndex index) {
  static std::array<std::atomic<int>, 256> cached{};  // 0: not asked yet
  std::atomic<int>& slot = cached.at(static_cast<size_t>(index));
  int kiloHertz = slot.load(std::memory_order_relaxed);
  if (kiloHertz == 0) {
    // cudaDeviceProp::clockRate is gone in CUDA 13; the attribute stays
    DCPLAN_CUDA_CHECK(cudaDeviceGetAttribute(&kiloHertz, cudaDevAttrClockRate, index));
    slot.store(kiloHertz > 0 ? kiloHertz : -1, std::memory_order_relaxed);
  }
  return kiloHertz;
}

}  // namespace

bool queueDeviceSleep(c10::Device device, double us) {
  if (!device.is_cuda() || !(us > 0)) return false;
  // "cuda" without an index is the current device (the cache is by index).
  const c10::DeviceIndex index = device.has_index() ? device.index() : c10::cuda::current_device();
  c10::cuda::CUDAGuard guard(index);
  const int kiloHertz = clockKiloHertz(index);
  if (kiloHertz <= 0) return false;
  at::cuda::sleep(static_cast<int64_t>(std::ceil(us * static_cast<double>(kiloHertz) / 1000.0)));
  return true;
}

}  // namespace dcplan::replayer
