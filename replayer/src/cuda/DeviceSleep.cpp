// queueDeviceSleep on CUDA: torch's spin kernel, sized by the device's rated SM clock.
#include "dcplan/replayer/DeviceSleep.h"

#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <cmath>

#include "cuda/CudaCheck.h"

namespace dcplan::replayer {

bool queueDeviceSleep(c10::Device device, double us) {
  if (!device.is_cuda() || !(us > 0)) return false;
  c10::cuda::CUDAGuard guard(device);
  int kiloHertz = 0;  // cudaDeviceProp::clockRate is gone in CUDA 13; the attribute stays
  DCPLAN_CUDA_CHECK(cudaDeviceGetAttribute(&kiloHertz, cudaDevAttrClockRate, device.index()));
  if (kiloHertz <= 0) return false;
  at::cuda::sleep(static_cast<int64_t>(std::ceil(us * static_cast<double>(kiloHertz) / 1000.0)));
  return true;
}

}  // namespace dcplan::replayer
