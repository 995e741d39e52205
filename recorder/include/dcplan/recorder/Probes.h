// Where the recorder reads time and memory: host clock and CPU allocator now, device events later.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "dcplan/schemas/trace.h"

namespace dcplan::recorder {

/// The streams of the trace format; an event's times are taken on its stream.
using schemas::Stream;
using schemas::streamName;

/// An opaque point in time made by a DeviceTimer; only that timer can read it.
using TimePoint = int64_t;

/// Takes time points on a stream and turns them into microseconds later. The
/// host timer reads a steady clock at mark(); a device timer (the CUDA build)
/// records an event on the stream at mark() and resolves it in elapsedUs(),
/// which the recorder calls only when it assembles the trace, after the steps.
class DeviceTimer {
 public:
  virtual ~DeviceTimer() = default;
  virtual TimePoint mark(Stream stream) = 0;
  /// Microseconds from `from` to `to` (negative when `to` is earlier).
  virtual double elapsedUs(TimePoint from, TimePoint to) = 0;
  /// Queues at least `us` of busy work where marks are taken, so that the device runs that far
  /// behind the host (the device-lead step); false where it cannot (the host's clock).
  virtual bool queueLead(double us) { return false; }
  /// Waits until everything queued so far has run (after a device-lead step).
  virtual void drain() {}
  /// The device has run everything queued up to `point`, without waiting (the host's clock: it
  /// has). In a device-lead step, a mark the device has reached when the host issues the next
  /// op means the device caught up with the host.
  virtual bool reached(TimePoint point) { return true; }
};

/// Memory in use, as the trace's memory_bytes and baseline_bytes report it.
class MemoryProbe {
 public:
  virtual ~MemoryProbe() = default;
  /// Bytes in use now; called when each op is issued, so it must be cheap.
  virtual uint64_t bytesInUse() = 0;
  /// The most bytes in use since the previous call (at least bytesInUse() now); starts the
  /// next window. Called when each op ends and when the next is issued: the peak of the
  /// compute between them, which the bytes in use at the ops alone miss (an attention
  /// backward's temporaries, say). A probe that tracks no peak answers bytesInUse().
  virtual uint64_t takePeakBytes() { return bytesInUse(); }
  /// Capacity of the memory bytesInUse() counts from.
  virtual uint64_t capacityBytes() = 0;
  /// One line saying what is counted, for docs and logs.
  virtual std::string describe() = 0;
};

/// The recorder's own work on the host outside the runtime's ops, which a replay does not do (the
/// hooks' saved-activation bookkeeping and the optimizer post-hook's, in Python): added here as it
/// ends, and left out of every host reading (hostClockNs) from then on, so that the compute around
/// it is timed as a replay runs it. (On a GPU the device may idle through it: the planner runs an
/// eager step on the device's own times where the trace has them, docs/planning.md.)
void addOwnHostWorkNs(int64_t ns);

/// The host's steady clock in nanoseconds, less the recorder's own work so far (addOwnHostWorkNs):
/// what the recorder reads the host's times with, and the CPU's timer.
int64_t hostClockNs();

/// hostClockNs() at mark(); elapsedUs is exact.
std::unique_ptr<DeviceTimer> makeHostTimer();

/// Events on the device's current stream, through torch's device-generic
/// interface (c10::impl::DeviceGuardImplInterface; CUDA when torch_cuda is
/// loaded), so this builds without the device's headers. elapsedUs()
/// synchronizes the device once for the marks made so far. The compute stream
/// is the one timeline: a collective's launch and completion are marked there,
/// where compute issues and then waits for it.
std::unique_ptr<DeviceTimer> makeDeviceEventTimer(c10::Device device);

/// The device caching allocator's allocated bytes (c10::getDeviceAllocator;
/// for CUDA the same number as torch.cuda.memory_allocated()); capacity: the
/// device's total memory. takePeakBytes() reads the allocator's peak statistic and
/// resets it, so while recording torch.cuda.max_memory_allocated() covers one op's
/// window only.
std::unique_ptr<MemoryProbe> makeDeviceAllocatorProbe(c10::Device device);

/// What a run's peak memory is, as measured for the replay log (dcplan.check_replay): the CPU
/// probe above (the peak since the previous call), or the device allocator's peak statistic
/// without resetting it (the peak since the process started or torch's last reset), so that
/// torch.cuda.max_memory_allocated() keeps its meaning for the job.
std::unique_ptr<MemoryProbe> makeRunPeakProbe(c10::Device device);

/// What the replay log reads at each op: on the CPU the counting probe with a peak window of its
/// own (a recording or a run's peak in the same process reads theirs undisturbed); on a device the
/// allocator's bytes in use (its peak statistic is never reset: takePeakBytes() is the run's peak).
std::unique_ptr<MemoryProbe> makeReplayOpProbe(c10::Device device);

/// What recording on `device` uses: the host timer and CPU memory probe for the
/// CPU, device events and the device allocator otherwise, and for the calibration a host wait for
/// the device's queued work and a timer of its own (CalibrationOptions; both empty for the CPU).
struct DeviceProbes {
  std::unique_ptr<DeviceTimer> timer;
  std::unique_ptr<MemoryProbe> memory;
  std::function<void()> synchronize;
  std::shared_ptr<DeviceTimer> queuedTimer;
};
DeviceProbes makeProbes(c10::Device device);

/// Host memory as the CPU allocator sees it: installs (once per process) a
/// counting wrapper around torch's CPU allocator, so that bytesInUse() is the
/// bytes of live CPU tensors allocated since then (shards, gradient buffers,
/// optimizer state, gathered parameters, activations). Tensors allocated
/// before the first call are not counted. Capacity: physical memory, or the
/// cgroup limit when lower. When another allocator of higher priority is
/// installed, falls back to the process's resident set size.
std::unique_ptr<MemoryProbe> makeCpuMemoryProbe();

}  // namespace dcplan::recorder
