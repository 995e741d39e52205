// queueDeviceSleep without CUDA: no device to run behind the host.
#include "dcplan/replayer/DeviceSleep.h"

namespace dcplan::replayer {

bool queueDeviceSleep(c10::Device, double) { return false; }

}  // namespace dcplan::replayer
