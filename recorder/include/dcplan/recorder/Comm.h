// The recorder's view of communication: a timing Transport decorator and the calibration.
#pragma once

#include "dcplan/replayer/Transport.h"
#include "dcplan/schemas/trace.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>

namespace dcplan::recorder {

class DeviceTimer;  // Probes.h

enum class CollectiveKind { Gather, Reduce, Copy };

/// Told by a timed transport when each collective is launched and when it was
/// first seen complete.
class CollectiveListener {
 public:
  virtual ~CollectiveListener() = default;
  /// Called just before the collective is handed to the wrapped transport;
  /// returns a token for onCollectiveDone, or -1 to hear nothing more of it.
  virtual int64_t onCollectiveLaunch(CollectiveKind kind) = 0;
  /// The wrapped handle exists: the listener may poll `handle->isCompleted()`.
  virtual void onCollectiveHandle(int64_t token, const std::shared_ptr<replayer::CommHandle>& handle) {}
  /// The collective's wait() returned, or isCompleted() said true, for the first time.
  virtual void onCollectiveDone(int64_t token) = 0;
};

/// A Transport that forwards everything to `inner` and reports launches and
/// completions to `listener` (held weakly: a gone listener hears nothing).
std::shared_ptr<replayer::Transport> makeTimedTransport(std::shared_ptr<replayer::Transport> inner,
                                                        std::weak_ptr<CollectiveListener> listener);

struct CalibrationOptions {
  /// Total time the measurement may take, in seconds (agreed on by all ranks).
  double budgetSeconds = 3.0;
  /// Timed repetitions per size and collective; the median is kept.
  int repetitions = 5;
  /// Smallest and largest full message size in bytes; sizes grow by 4x.
  uint64_t minBytes = 64 * 1024;
  uint64_t maxBytes = uint64_t{1} << 30;
  /// Sizes always measured, whatever the budget, so that a curve has a slope.
  int minPoints = 3;
  /// Device of the buffers (the transport's device).
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  /// Makes the host wait for the device's queued work (a no-op on CPU), so that
  /// host clock times are device times. Called after each wait().
  std::function<void()> synchronize;
  /// A device's event timer (makeDeviceEventTimer), which times each call again on the device behind
  /// a queued lead: the points' device_us. Null (CPU ranks): not timed.
  std::shared_ptr<DeviceTimer> queuedTimer;
};

/// The largest `value` over the ranks of `transport` (an all-reduce on options.device, then a
/// wait for it). Collective: every rank calls it at the same point.
double agreeOnMax(replayer::Transport& transport, const CalibrationOptions& options, double value);

/// Measures all-gather, reduce-scatter and all-reduce time against message size
/// through `transport` (with options.queuedTimer, each also on the device alone), and the
/// host<->device copy rate when the device is not the CPU. Collective: every rank of the
/// transport calls it with the same options.
schemas::Calibration calibrate(replayer::Transport& transport, const CalibrationOptions& options);

/// The collectives of `transport` measured alone, without a model: a dcplan.network/v1 document's
/// content (python -m dcplan.measure_network), for planning at this world size from a trace
/// recorded at another (dcplan plan --network). Collective, as calibrate().
schemas::Network measureNetwork(replayer::Transport& transport, const CalibrationOptions& options,
                                const std::string& deviceName);

}  // namespace dcplan::recorder
