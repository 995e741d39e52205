// The timing Transport decorator and the communication calibration.
#include "dcplan/recorder/Comm.h"

#include "dcplan/recorder/Probes.h"
#include "dcplan/replayer/ForwardingTransport.h"
#include "dcplan/schemas/replay_log.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <vector>

namespace dcplan::recorder {

using replayer::CommHandle;
using replayer::CommHandlePtr;
using replayer::ForwardingTransport;
using replayer::Transport;

namespace {

/// Reports the first time its collective is seen complete.
class TimedHandle final : public CommHandle {
 public:
  TimedHandle(CommHandlePtr inner, std::weak_ptr<CollectiveListener> listener, int64_t token)
      : inner_(std::move(inner)), listener_(std::move(listener)), token_(token) {}

  void wait() override {
    inner_->wait();
    report();
  }
  /// The wrapped transport's own handle: its runAfter needs its own kind (a device transport
  /// reads the collective's stream from it).
  const CommHandlePtr& inner() const { return inner_; }
  /// The collective is known complete where the caller's work ordered after it starts.
  void completedHere() { report(); }
  bool isCompleted() override {
    const bool completed = inner_->isCompleted();
    if (completed) report();
    return completed;
  }

 private:
  void report() {
    if (reported_) return;
    reported_ = true;
    if (auto l = listener_.lock()) l->onCollectiveDone(token_);
  }

  CommHandlePtr inner_;
  std::weak_ptr<CollectiveListener> listener_;
  int64_t token_;
  bool reported_ = false;
};

class TimedTransport final : public ForwardingTransport {
 public:
  TimedTransport(std::shared_ptr<Transport> inner, std::weak_ptr<CollectiveListener> listener)
      : ForwardingTransport(std::move(inner)), listener_(std::move(listener)) {}

  // Gathers, reductions and copies are timed; every other seam is forwarded (ForwardingTransport),
  // so that a device transport keeps its streams and events under the recorder.
  CommHandlePtr allGather(const at::Tensor& output, const at::Tensor& input) override {
    return timed(CollectiveKind::Gather, [&] { return inner().allGather(output, input); });
  }
  CommHandlePtr allGatherCoalesced(const std::vector<at::Tensor>& outputs,
                                   const std::vector<at::Tensor>& inputs) override {
    return timed(CollectiveKind::Gather, [&] { return inner().allGatherCoalesced(outputs, inputs); });
  }
  CommHandlePtr reduceScatter(const at::Tensor& output, const at::Tensor& input) override {
    return timed(CollectiveKind::Reduce, [&] { return inner().reduceScatter(output, input); });
  }
  CommHandlePtr allReduce(const at::Tensor& tensor) override {
    return timed(CollectiveKind::Reduce, [&] { return inner().allReduce(tensor); });
  }
  CommHandlePtr gatherShards(const std::vector<at::Tensor>& outputs,
                             const std::vector<at::Tensor>& shards) override {
    return timed(CollectiveKind::Gather, [&] { return inner().gatherShards(outputs, shards); });
  }
  CommHandlePtr copyAsync(const at::Tensor& dst, const at::Tensor& src, CopyKind kind) override {
    return timed(CollectiveKind::Copy, [&] { return inner().copyAsync(dst, src, kind); });
  }
  // The wrapped transport orders work after its own kind of handle, not after the timing wrapper.
  // The work starts where the collective is over, in the collective's own order (a device
  // transport runs it on the collective's stream, a host one after the wait): the collective's
  // end is marked there, before the work. (The runtime drops the handle once the work is
  // queued, so the end would otherwise go unseen.)
  CommHandlePtr runAfter(const CommHandlePtr& done, const std::function<void()>& work) override {
    auto* t = dynamic_cast<TimedHandle*>(done.get());
    if (t == nullptr) return inner().runAfter(done, work);
    return inner().runAfter(t->inner(), [t, &work] {
      t->completedHere();
      work();
    });
  }

 private:
  template <typename Launch>
  CommHandlePtr timed(CollectiveKind kind, Launch&& launch) {
    auto listener = listener_.lock();
    const int64_t token = listener ? listener->onCollectiveLaunch(kind) : -1;
    CommHandlePtr handle = launch();
    if (token < 0) return handle;
    auto wrapped = std::make_shared<TimedHandle>(std::move(handle), listener_, token);
    listener->onCollectiveHandle(token, wrapped);
    return wrapped;
  }

  std::weak_ptr<CollectiveListener> listener_;
};

double secondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// The device's lead over the host when a call is timed on the device (CalibrationPoint::deviceUs):
/// far above one launch's host time (tens of microseconds).
constexpr double kQueuedLeadUs = 1000.0;

/// One call timed on the device alone: a sleep queued first keeps the device behind the host until
/// the call and the wait for it are queued, so that neither the launch nor the wait's host time is in
/// it, as in a CUDA graph's replay; the median of the repetitions the device did not catch up in.
/// Every rank makes every call, whatever its timer did (a repetition is dropped, never retried or
/// skipped: the ranks' calls must pair up). Absent where no repetition was led, stayed queued and
/// took a time above 0.
template <typename Launch>
std::optional<double> queuedUs(DeviceTimer& timer, int repetitions, Launch&& launch) {
  std::vector<double> us;
  for (int r = 0; r < repetitions; ++r) {
    const bool led = timer.queueLead(kQueuedLeadUs);
    const TimePoint from = timer.mark(Stream::Compute);
    launch()->wait();  // a device transport's wait orders the compute stream after the call
    const TimePoint to = timer.mark(Stream::Compute);
    const bool queuedFirst = led && !timer.reached(from);
    const double elapsed = timer.elapsedUs(from, to);  // waits for the device
    if (queuedFirst && elapsed > 0) us.push_back(elapsed);  // 0: the events' resolution, not a time
  }
  if (us.empty()) return std::nullopt;
  return schemas::medianOf(us);
}

}  // namespace

std::shared_ptr<Transport> makeTimedTransport(std::shared_ptr<Transport> inner,
                                              std::weak_ptr<CollectiveListener> listener) {
  TORCH_CHECK(inner != nullptr, "record: the transport to time should not be null");
  return std::make_shared<TimedTransport>(std::move(inner), std::move(listener));
}

double agreeOnMax(Transport& transport, const CalibrationOptions& o, double value) {
  const int64_t ws = transport.worldSize();
  if (ws == 1) return value;
  // Each rank's value in its own slot of a summing all-reduce: every rank then sees them all.
  at::Tensor all = at::zeros({ws}, at::TensorOptions().dtype(at::kDouble).device(o.device));
  all[transport.rank()].fill_(value);
  transport.allReduce(all)->wait();
  return all.max().item<double>();  // item() waits for the device
}

namespace {

/// Calibration::computeProbeUs of CPU ranks: eight fp32 products of 256 x 256 (about a millisecond
/// on one core) on every rank at once (the all-reduce before lines them up), as they compute in
/// training, so that ranks sharing a host's cores show it; the median of five timings after one
/// untimed, the slowest rank's. (A GPU computes on its own: no what-if scales its compute.)
double computeProbe(Transport& transport, const CalibrationOptions& o) {
  const int64_t n = 256;
  const int products = 8;
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(o.device);
  const at::Tensor a = at::full({n, n}, 1.0f / static_cast<float>(n), opts);
  at::Tensor out = at::empty({n, n}, opts);
  auto sync = [&] {
    if (o.synchronize) o.synchronize();
  };
  auto run = [&] {
    for (int k = 0; k < products; ++k) at::mm_out(out, a, a);
    sync();
  };
  agreeOnMax(transport, o, 0.0);
  run();
  std::vector<double> us;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    us.push_back(secondsSince(t0) * 1e6);
  }
  return agreeOnMax(transport, o, schemas::medianOf(us));
}

}  // namespace

schemas::Calibration calibrate(Transport& transport, const CalibrationOptions& o) {
  TORCH_CHECK(o.repetitions >= 1, "calibrate: repetitions should be >= 1, got ", o.repetitions);
  TORCH_CHECK(o.minBytes > 0 && o.minBytes <= o.maxBytes,
              "calibrate: minBytes should be in (0, maxBytes], got ", o.minBytes);
  const int64_t ws = transport.worldSize();
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(o.device);
  auto sync = [&] {
    if (o.synchronize) o.synchronize();
  };
  // The median of the timed repetitions, after one untimed run that warms the
  // path (connections, allocator) up; then on the device alone where it can be.
  auto measure = [&](uint64_t fullBytes, auto&& launch) {
    launch()->wait();
    sync();
    std::vector<double> us;
    for (int r = 0; r < o.repetitions; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      launch()->wait();
      sync();
      us.push_back(secondsSince(t0) * 1e6);
    }
    schemas::CalibrationPoint point{fullBytes, schemas::medianOf(us)};
    if (o.queuedTimer) point.deviceUs = queuedUs(*o.queuedTimer, o.repetitions, launch);
    return point;
  };

  schemas::Calibration cal;
  const auto started = std::chrono::steady_clock::now();
  at::Tensor agreed = at::zeros({2}, opts);  // elapsed seconds, cost of the last size (us)
  for (uint64_t bytes = o.minBytes; bytes <= o.maxBytes; bytes *= 4) {
    // float32 elements per rank; the recorded size is the full message actually sent.
    const int64_t perRank = std::max<int64_t>(1, static_cast<int64_t>(bytes / 4) / ws);
    const uint64_t full = static_cast<uint64_t>(perRank * ws * 4);
    at::Tensor shard = at::zeros({perRank}, opts);
    at::Tensor gathered = at::zeros({perRank * ws}, opts);  // also the all-reduce buffer: no NaNs
    cal.allGather.push_back(measure(full, [&] { return transport.allGather(gathered, shard); }));
    at::Tensor scatterIn = at::zeros({ws, perRank}, opts);
    at::Tensor scatterOut = at::empty({perRank}, opts);
    cal.reduceScatter.push_back(
        measure(full, [&] { return transport.reduceScatter(scatterOut, scatterIn); }));
    cal.allReduce.push_back(measure(full, [&] { return transport.allReduce(gathered); }));

    // Whether to go on must be the same decision on every rank, or the ranks
    // would part ways in the middle of a collective: decide on the mean elapsed
    // time and the mean cost of this size, which the all-reduce makes
    // bit-identical everywhere (each rank's own timings differ). The next size
    // takes about 4x as long as this one did.
    const double sizeCost = cal.allGather.back().us + cal.reduceScatter.back().us + cal.allReduce.back().us;
    agreed[0].fill_(secondsSince(started));
    agreed[1].fill_(sizeCost);
    transport.allReduce(agreed)->wait();
    sync();
    const double mean = agreed[0].item<double>() / static_cast<double>(ws);
    const double meanCost = agreed[1].item<double>() / static_cast<double>(ws);
    // Each call once untimed and `repetitions` times, and as often again behind a lead where timed
    // on the device too.
    const double calls = o.repetitions + 1 + (o.queuedTimer ? o.repetitions : 0);
    const double leads = o.queuedTimer ? 3.0 * o.repetitions * kQueuedLeadUs : 0.0;
    const double next = (4.0 * meanCost * calls + leads) * 1e-6;
    if (static_cast<int>(cal.allGather.size()) >= o.minPoints && mean + next > o.budgetSeconds) break;
  }

  {
    // Host<->device copy rate with pinned host memory, as offloading copies; on CPU ranks the
    // offload copies into a host pool of its own, a memcpy each way.
    const int64_t n = 16 * 1024 * 1024;  // 64 MiB of float32
    at::Tensor host = at::empty({n}, at::TensorOptions().dtype(at::kFloat).pinned_memory(!o.device.is_cpu()));
    at::Tensor dev = at::empty({n}, opts);
    host.zero_();
    dev.zero_();
    auto rate = [&](at::Tensor& dst, const at::Tensor& src) {
      std::vector<double> gbps;
      dst.copy_(src);
      sync();
      for (int r = 0; r < 3; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        dst.copy_(src);
        sync();
        gbps.push_back(static_cast<double>(n * 4) / 1e9 / std::max(secondsSince(t0), 1e-9));
      }
      return schemas::medianOf(gbps);
    };
    cal.h2dGBps = rate(dev, host);
    cal.d2hGBps = rate(host, dev);
  }
  if (o.device.is_cpu()) cal.computeProbeUs = computeProbe(transport, o);
  return cal;
}

schemas::Network measureNetwork(Transport& transport, const CalibrationOptions& options,
                                const std::string& deviceName) {
  schemas::Network network;
  network.createdBy = std::string("dcplan-recorder ") + DCPLAN_VERSION;
  network.worldSize = transport.worldSize();
  network.backend = transport.backendName();
  network.device = deviceName;
  network.calibration = calibrate(transport, options);
  return network;
}

}  // namespace dcplan::recorder
