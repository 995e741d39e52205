// Busy work queued on a device's stream: how the recorder makes the device run behind the host.
#pragma once

#include <c10/core/Device.h>

namespace dcplan::replayer {

/// Queues a kernel that keeps `device`'s current stream busy for at least `us` microseconds (it
/// spins on the SM clock for `us` at the rated clock rate; longer where the clock runs slower).
/// Returns false, queuing nothing, where the device or the build cannot: the CPU, a build without
/// CUDA.
bool queueDeviceSleep(c10::Device device, double us);

}  // namespace dcplan::replayer
