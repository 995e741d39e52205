// Host timer and CPU memory probe: the recorder's time and memory on CPU runs.
#include "dcplan/recorder/Probes.h"

#include "dcplan/replayer/DeviceSleep.h"
#include "dcplan/replayer/HostClock.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <fstream>
#include <mutex>
#include <new>
#include <vector>

namespace dcplan::recorder {

namespace {

/// addOwnHostWorkNs's sum.
std::atomic<int64_t> gOwnHostWorkNs{0};

class HostTimer final : public DeviceTimer {
 public:
  TimePoint mark(Stream) override { return hostClockNs(); }
  double elapsedUs(TimePoint from, TimePoint to) override { return static_cast<double>(to - from) / 1000.0; }
};

/// Wraps torch's CPU allocator and counts the bytes of the blocks it handed out
/// that are still alive. Every block carries its size in its DataPtr context, so
/// the count is exact whichever thread frees it.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  explicit CountingCpuAllocator(c10::Allocator* inner) : inner_(inner) {}

  // The counting record sits in a header in front of the data, so that the DataPtr's context
  // is its data pointer: Allocator::raw_allocate (oneDNN's bf16 kernels use it) requires that.
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr block = inner_->allocate(n + kHeader);
    auto* base = static_cast<char*>(block.get());
    void* data = base + kHeader;
    new (base) Header{std::move(block), n, this};
    const uint64_t now = live_.fetch_add(n, std::memory_order_relaxed) + n;
    for (std::atomic<uint64_t>& window : peak_) {
      uint64_t peak = window.load(std::memory_order_relaxed);
      while (now > peak && !window.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
      }
    }
    return {data, data, &CountingCpuAllocator::release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CountingCpuAllocator::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  /// Independent peak windows, so that a run's peak and a per-op window can be read at once.
  enum Window : size_t { kRecordWindow = 0, kRunWindow = 1, kReplayOpWindow = 2, kWindows = 3 };

  uint64_t live() const { return live_.load(std::memory_order_relaxed); }
  /// The most bytes live in `window` since its previous call; its next window starts at the bytes
  /// live now.
  uint64_t takePeak(Window window) {
    const uint64_t now = live();
    return std::max(peak_[window].exchange(now, std::memory_order_relaxed), now);
  }

 private:
  struct Header {
    c10::DataPtr inner;  // owns the whole block, header included
    size_t bytes;
    CountingCpuAllocator* owner;
  };
  // A multiple of torch's CPU alignment (64), so the data stays as aligned as the block.
  static constexpr size_t kHeader = (sizeof(Header) + 63) / 64 * 64;

  static void release(void* data) {
    auto* h = reinterpret_cast<Header*>(static_cast<char*>(data) - kHeader);
    h->owner->live_.fetch_sub(h->bytes, std::memory_order_relaxed);
    c10::DataPtr inner = std::move(h->inner);
    h->~Header();
    // inner frees the block (header and data) through its own deleter here.
  }

  c10::Allocator* inner_;
  std::atomic<uint64_t> live_{0};
  std::array<std::atomic<uint64_t>, kWindows> peak_{};
};

/// Installed at most once per process and never destroyed: tensors it
/// allocated may outlive the recorder (and static destruction).
CountingCpuAllocator* countingAllocator() {
  static CountingCpuAllocator* installed = [] {
    c10::Allocator* current = c10::GetCPUAllocator();
    auto* counting = new CountingCpuAllocator(current);
    // Priority 1 wins over torch's default (0); an allocator someone installed
    // with a higher priority stays, and we fall back to the RSS.
    c10::SetCPUAllocator(counting, /*priority=*/1);
    return c10::GetCPUAllocator() == counting ? counting : nullptr;
  }();
  return installed;
}

uint64_t residentBytes() {
  std::ifstream statm("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

uint64_t hostCapacityBytes() {
  uint64_t bytes =
      static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  // A container's limit is the capacity that matters (cgroup v2, then v1).
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(path);
    uint64_t limit = 0;
    if (in >> limit && limit > 0 && limit < bytes) bytes = limit;
  }
  return bytes;
}

class CpuMemoryProbe final : public MemoryProbe {
 public:
  explicit CpuMemoryProbe(CountingCpuAllocator::Window window)
      : counter_(countingAllocator()), capacity_(hostCapacityBytes()), window_(window) {}
  uint64_t bytesInUse() override { return counter_ ? counter_->live() : residentBytes(); }
  uint64_t takePeakBytes() override { return counter_ ? counter_->takePeak(window_) : residentBytes(); }
  uint64_t capacityBytes() override { return capacity_; }
  std::string describe() override {
    return counter_ ? "bytes of live CPU tensors (counting wrapper around torch's CPU allocator)"
                    : "resident set size of the process (another CPU allocator is installed)";
  }

 private:
  CountingCpuAllocator* counter_;
  uint64_t capacity_;
  CountingCpuAllocator::Window window_;
};

class DeviceEventTimer final : public DeviceTimer {
 public:
  explicit DeviceEventTimer(c10::Device device)
      : device_(device), impl_(c10::impl::getDeviceGuardImpl(device.type())) {
    TORCH_CHECK(device.has_index(), "record: device ", device, " should name its index (e.g. cuda:0)");
  }
  ~DeviceEventTimer() override {
    for (void* e : events_) impl_->destroyEvent(e, device_.index());
  }
  TimePoint mark(Stream) override {
    void* event = nullptr;
    // BACKEND_DEFAULT: an event that keeps timing (CUDA: cudaEventDefault).
    impl_->record(&event, impl_->getStream(device_), device_.index(), c10::EventFlag::BACKEND_DEFAULT);
    events_.push_back(event);
    return static_cast<TimePoint>(events_.size() - 1);
  }
  double elapsedUs(TimePoint from, TimePoint to) override {
    if (synchronizedUpTo_ < events_.size()) {
      impl_->synchronizeDevice(device_.index());
      synchronizedUpTo_ = events_.size();
    }
    return impl_->elapsedTime(events_.at(static_cast<size_t>(from)), events_.at(static_cast<size_t>(to)),
                              device_.index()) *
           1000.0;
  }
  bool queueLead(double us) override { return replayer::queueDeviceSleep(device_, us); }
  void drain() override { impl_->synchronizeDevice(device_.index()); }
  bool reached(TimePoint point) override { return impl_->queryEvent(events_.at(static_cast<size_t>(point))); }

 private:
  c10::Device device_;
  const c10::impl::DeviceGuardImplInterface* impl_;
  std::vector<void*> events_;
  size_t synchronizedUpTo_ = 0;
};

class DeviceAllocatorProbe final : public MemoryProbe {
 public:
  DeviceAllocatorProbe(c10::Device device, bool resetPeak)
      : allocator_(c10::getDeviceAllocator(device.type())), index_(device.index()), resetPeak_(resetPeak) {
    try {
      capacity_ = allocator_->getMemoryInfo(index_).second;
    } catch (const c10::Error&) {
      capacity_ = 0;  // an allocator that cannot say: the planner then has no capacity
    }
  }
  uint64_t bytesInUse() override {
    const auto stats = allocator_->getDeviceStats(index_);
    return static_cast<uint64_t>(
        stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current);
  }
  uint64_t takePeakBytes() override {
    const auto stats = allocator_->getDeviceStats(index_);
    const auto& allocated =
        stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
    if (resetPeak_) allocator_->resetPeakStats(index_);  // the next window starts now
    return static_cast<uint64_t>(std::max(allocated.peak, allocated.current));
  }
  uint64_t capacityBytes() override { return capacity_; }
  std::string describe() override { return "allocated bytes of the device's caching allocator"; }

 private:
  c10::DeviceAllocator* allocator_;
  c10::DeviceIndex index_;
  bool resetPeak_;
  uint64_t capacity_ = 0;
};

}  // namespace

void addOwnHostWorkNs(int64_t ns) {
  if (ns > 0) gOwnHostWorkNs.fetch_add(ns, std::memory_order_relaxed);
}

int64_t hostClockNs() { return replayer::monotonicNs() - gOwnHostWorkNs.load(std::memory_order_relaxed); }

std::unique_ptr<DeviceTimer> makeHostTimer() { return std::make_unique<HostTimer>(); }

std::unique_ptr<DeviceTimer> makeDeviceEventTimer(c10::Device device) {
  return std::make_unique<DeviceEventTimer>(device);
}

std::unique_ptr<MemoryProbe> makeDeviceAllocatorProbe(c10::Device device) {
  return std::make_unique<DeviceAllocatorProbe>(device, /*resetPeak=*/true);
}

std::unique_ptr<MemoryProbe> makeReplayOpProbe(c10::Device device) {
  if (device.is_cpu()) return std::make_unique<CpuMemoryProbe>(CountingCpuAllocator::kReplayOpWindow);
  return std::make_unique<DeviceAllocatorProbe>(device, /*resetPeak=*/false);
}

std::unique_ptr<MemoryProbe> makeRunPeakProbe(c10::Device device) {
  if (device.is_cpu()) return std::make_unique<CpuMemoryProbe>(CountingCpuAllocator::kRunWindow);
  return std::make_unique<DeviceAllocatorProbe>(device, /*resetPeak=*/false);
}

DeviceProbes makeProbes(c10::Device device) {
  DeviceProbes p;
  if (device.is_cpu()) {
    p.timer = makeHostTimer();
    p.memory = makeCpuMemoryProbe();
    return p;
  }
  p.timer = makeDeviceEventTimer(device);
  p.memory = makeDeviceAllocatorProbe(device);
  const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
  p.synchronize = [impl, index = device.index()] { impl->synchronizeDevice(index); };
  p.queuedTimer = makeDeviceEventTimer(device);
  return p;
}

std::unique_ptr<MemoryProbe> makeCpuMemoryProbe() {
  return std::make_unique<CpuMemoryProbe>(CountingCpuAllocator::kRecordWindow);
}

}  // namespace dcplan::recorder
