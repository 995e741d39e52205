// Calibration-curve interpolation and what-if re-scaling of collective times.
#include "dcplan/planner/cost_model.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "dcplan/planner/units.h"

namespace dcplan::planner {
namespace {

/// Ring all-gather / reduce-scatter move (N-1)/N of the message over each link.
double ringFactor(int64_t worldSize) {
  return worldSize <= 1 ? 0.0 : static_cast<double>(worldSize - 1) / static_cast<double>(worldSize);
}

/// The first calibration point not timed on the device (CalibrationPoint::deviceUs > 0), as
/// "all_reduce[7]"; "" where every point of every curve was. The whole calibration is read one way or
/// the other, so that no collective is charged the host's share beside another that is not, and a
/// curve is not bent where the kind would change.
std::string firstHostTimedPoint(const schemas::Calibration& c) {
  const std::pair<const char*, const std::vector<schemas::CalibrationPoint>*> curves[] = {
      {"all_gather", &c.allGather}, {"reduce_scatter", &c.reduceScatter}, {"all_reduce", &c.allReduce}};
  for (const auto& [name, points] : curves) {
    for (size_t i = 0; i < points->size(); ++i) {
      const auto& us = (*points)[i].deviceUs;
      if (!us || !(*us > 0)) return std::string(name) + "[" + std::to_string(i) + "]";
    }
  }
  return "";
}

}  // namespace

const char* collectiveName(Collective c) {
  switch (c) {
    case Collective::AllGather:
      return "all_gather";
    case Collective::ReduceScatter:
      return "reduce_scatter";
    case Collective::AllReduce:
      return "all_reduce";
  }
  return "?";
}

CostModel::Curve CostModel::buildCurve(const std::vector<schemas::CalibrationPoint>& points,
                                       double traceBusFactor, bool deviceTimed) {
  Curve c;
  for (const auto& p : points) {
    const double us = deviceTimed ? *p.deviceUs : p.us;
    // Zero-byte or zero-time points cannot be placed on a log scale; the
    // validator allows them, so skip rather than fail.
    if (p.bytes == 0 || !(us > 0)) continue;
    double b = static_cast<double>(p.bytes);
    if (!c.bytes.empty() && b <= c.bytes.back()) continue;  // keep strictly increasing
    c.bytes.push_back(b);
    c.usec.push_back(us);
  }
  if (c.bytes.empty()) return c;
  size_t n = c.bytes.size();
  // A smaller message is never slower than a larger one: a point above its successor is noise.
  for (size_t i = n - 1; i-- > 0;) c.usec[i] = std::min(c.usec[i], c.usec[i + 1]);
  for (size_t i = 0; i < n; ++i) {
    c.logBytes.push_back(std::log(c.bytes[i]));
    c.logUs.push_back(std::log(c.usec[i]));
  }
  if (n >= 2) {
    double slope = (c.usec[1] - c.usec[0]) / (c.bytes[1] - c.bytes[0]);
    c.latencyUs = std::clamp(c.usec[0] - slope * c.bytes[0], 0.0, c.usec[0]);
    double dt = c.usec[n - 1] - c.usec[n - 2];
    double db = c.bytes[n - 1] - c.bytes[n - 2];
    double average = c.bytes[n - 1] / c.usec[n - 1];
    // The marginal rate of the last segment is the best guess for larger
    // messages; noise can make it absurd, so keep it within sane bounds of the
    // average rate of the largest point.
    double marginal = dt > 0 ? db / dt : average * 4;
    c.tailBytesPerUs = std::clamp(marginal, average, average * 4);
  } else {
    c.latencyUs = 0;
    c.tailBytesPerUs = c.bytes[0] / c.usec[0];
  }
  double busUs = c.usec[n - 1] - c.latencyUs;
  if (busUs > 0 && traceBusFactor > 0) {
    c.calibratedBusGBps = c.bytes[n - 1] * traceBusFactor / busUs / 1e3;
  }
  return c;
}

CostModel::CostModel(const schemas::Calibration& calibration, int64_t traceWorldSize,
                     const CostModelOptions& options)
    : traceWorldSize_(traceWorldSize),
      worldSize_(options.worldSize > 0 ? options.worldSize : traceWorldSize),
      h2dGBps_(calibration.h2dGBps),
      d2hGBps_(calibration.d2hGBps) {
  if (!(options.inSituScale > 0))
    throw std::invalid_argument("the in-situ scale of collectives should be > 0");
  inSitu_ = options.inSituScale;
  agreementChecks_ = options.agreementChecks;
  if (options.launchUs) {
    if (!(*options.launchUs >= 0)) throw std::invalid_argument("launch overhead should be >= 0 us");
    launchUs_ = *options.launchUs;
    launchMeasured_ = options.launchMeasured;
  }
  if (options.deviceQueued) hostTimedPoint_ = firstHostTimedPoint(calibration);
  deviceTimed_ = options.deviceQueued && hostTimedPoint_.empty();
  if (worldSize_ <= 1) {
    // One rank still issues every gather and ZeRO-1's all-reduce (ZeRO-2/3 reduce in place, in
    // us()): the transport copies the shard into the gathered buffer on its own stream, behind and
    // before an event on the compute stream. A trace recorded on one rank timed exactly those
    // calls; one recorded on more has nothing to go by, and they are taken as free.
    if (traceWorldSize_ == 1) {
      allGather_ = buildCurve(calibration.allGather, 1.0, deviceTimed_);
      reduceScatter_ = buildCurve(calibration.reduceScatter, 1.0, deviceTimed_);
      allReduce_ = buildCurve(calibration.allReduce, 1.0, deviceTimed_);
      oneRankCopies_ = !allGather_.bytes.empty();
      if (oneRankCopies_) standInMissingCurves();
      for (Curve* c : {&allGather_, &reduceScatter_, &allReduce_}) c->plannedBusGBps = c->calibratedBusGBps;
    }
    return;
  }
  if (traceWorldSize_ <= 1) {
    throw std::invalid_argument(
        "the trace was recorded on 1 rank and has no communication calibration to plan " +
        std::to_string(worldSize_) +
        " ranks with: record on 2 or more ranks, or measure the collectives where the "
        "job will run (torchrun ... -m dcplan.measure_network -o net.json) and plan "
        "with --network net.json");
  }
  double traceRing = ringFactor(traceWorldSize_);
  allGather_ = buildCurve(calibration.allGather, traceRing, deviceTimed_);
  if (allGather_.bytes.empty()) {
    throw std::invalid_argument("calibration.all_gather has no point with positive bytes and time");
  }
  reduceScatter_ = buildCurve(calibration.reduceScatter, traceRing, deviceTimed_);
  allReduce_ = buildCurve(calibration.allReduce, 2 * traceRing, deviceTimed_);
  standInMissingCurves();
  double busScale = ringFactor(worldSize_) / traceRing;
  for (Curve* c : {&allGather_, &reduceScatter_, &allReduce_}) {
    c->scale = busScale;
    if (options.busBandwidthGBps && c->calibratedBusGBps > 0) {
      c->scale *= c->calibratedBusGBps / *options.busBandwidthGBps;
    }
    c->plannedBusGBps = options.busBandwidthGBps && c->calibratedBusGBps > 0 ? *options.busBandwidthGBps
                                                                             : c->calibratedBusGBps;
  }
}

void CostModel::standInMissingCurves() {
  // A ring reduce-scatter moves what an all-gather moves, and an all-reduce is
  // both: stand-ins when a curve was not measured.
  if (reduceScatter_.bytes.empty()) reduceScatter_ = allGather_;
  if (allReduce_.bytes.empty()) {
    allReduce_ = reduceScatter_;
    for (double& u : allReduce_.usec) u *= 2;
    for (double& l : allReduce_.logUs) l += std::log(2.0);
    allReduce_.latencyUs *= 2;
    allReduce_.tailBytesPerUs /= 2;
  }
}

double CostModel::rawUs(const Curve& c, double b) {
  size_t n = c.bytes.size();
  if (b <= c.bytes[0]) {
    return c.latencyUs + (c.usec[0] - c.latencyUs) * (b / c.bytes[0]);
  }
  if (b >= c.bytes[n - 1]) {
    return c.usec[n - 1] + (b - c.bytes[n - 1]) / c.tailBytesPerUs;
  }
  size_t hi = static_cast<size_t>(std::upper_bound(c.bytes.begin(), c.bytes.end(), b) - c.bytes.begin());
  size_t lo = hi - 1;
  double lb = std::log(b);
  double f = (lb - c.logBytes[lo]) / (c.logBytes[hi] - c.logBytes[lo]);
  return std::exp(c.logUs[lo] + f * (c.logUs[hi] - c.logUs[lo]));
}

const CostModel::Curve& CostModel::curve(Collective c) const {
  switch (c) {
    case Collective::AllGather:
      return allGather_;
    case Collective::ReduceScatter:
      return reduceScatter_;
    case Collective::AllReduce:
      return allReduce_;
  }
  return allGather_;
}

double CostModel::us(Collective which, uint64_t fullBytes) const {
  if (callsFree() || fullBytes == 0) return 0;
  // One rank's bucket is its own reduction's output (RuntimeMemory::packsIntoOutput): the
  // transport returns the call at once, whatever the calibration timed of a copying one.
  if (worldSize_ <= 1 && which == Collective::ReduceScatter) return 0;
  const Curve& c = curve(which);
  double raw = rawUs(c, static_cast<double>(fullBytes));
  double lat = std::min(c.latencyUs, raw);
  return inSitu_ * (lat + (raw - lat) * c.scale);
}

std::string CostModel::graphHostTimed() const {
  if (hostTimedPoint_.empty() || callsFree()) return "";
  return "collectives host-timed: calibration." + hostTimedPoint_ +
         " has no device_us (a recording made before dcplan timed the collectives on the device, or a "
         "network file without them), so a CUDA graph's replay is charged the host's launch and wait, "
         "which it does not make: record again, or measure the network again (docs/planning.md, "
         "\"Collectives as a graph issues them\")";
}

double CostModel::checkUs(bool onUse) const {
  if (!agreementChecks_) return 0;
  // 2 CPU ranks (docs/planning.md): 0.20-0.33 ms a call where the default schedule gathers on use,
  // 0.4-1.0 ms in prefetching plans; 0.21 ms calibrated, 0.66 in situ.
  const double inSitu = us(Collective::AllGather,
                           kAgreementCheckBytes * static_cast<uint64_t>(std::max<int64_t>(1, worldSize_)));
  return onUse ? inSitu / inSitu_ : inSitu;
}

double CostModel::latencyUs(Collective which) const {
  return callsFree() ? 0 : inSitu_ * curve(which).latencyUs;
}

double CostModel::busGBps(Collective which) const {
  return callsFree() ? 0 : curve(which).plannedBusGBps / inSitu_;
}

double CostModel::copyUs(uint64_t bytes, bool hostToDevice) const {
  const std::optional<double>& rate = hostToDevice ? h2dGBps_ : d2hGBps_;
  if (!rate || !(*rate > 0)) return 0;
  return static_cast<double>(bytes) / (*rate * 1e3);
}

std::vector<std::string> CostModel::describe() const {
  std::vector<std::string> out;
  const bool oneRank = worldSize_ <= 1;
  if (callsFree()) {
    out.push_back("1 rank: no communication");
  } else {
    if (oneRank)
      out.push_back("1 rank: each gather is a copy on the transport's stream, as calibrated; a bucket's "
                    "ZeRO-2/3 reduction is in place, nothing to copy");
    std::vector<Collective> shown = {Collective::AllGather};
    if (!oneRank) shown.push_back(Collective::ReduceScatter);
    if (!oneRank) shown.push_back(Collective::AllReduce);  // one rank reduces without it
    for (Collective c : shown) {
      out.push_back(std::string(collectiveName(c)) + ": latency " + formatFixed(latencyUs(c), 1) + " us" +
                    (oneRank ? "" : ", bus " + formatFixed(busGBps(c), 1) + " GB/s") + ", 64 MiB in " +
                    formatFixed(us(c, 64ull << 20), 1) + " us" +
                    (deviceTimed_ ? " (timed on the device, as a CUDA graph issues it)" : ""));
    }
  }
  if (std::string hostTimed = graphHostTimed(); !hostTimed.empty()) out.push_back(std::move(hostTimed));
  if (agreementChecks_ && !callsFree()) {
    out.push_back("agreement checks (DCPLAN_CHECK_COLLECTIVES, trace meta.checks_collectives): " +
                  formatFixed(checkUs(true), 1) + " us of host time before a gather on use, " +
                  formatFixed(checkUs(false), 1) +
                  " before a prefetch or a bucket (in situ), every call (the recording ran without them)");
  }
  // At one rank the charge is shown only where the trace measured it.
  if (!oneRank || launchMeasured_) {
    out.push_back("issuing a collective: " + formatFixed(launchUs(), 1) +
                  " us of host time per call beyond those of the recorded run" +
                  (launchMeasured_ ? " (measured: the trace's gathers against its releases)" : ""));
  }
  return out;
}

}  // namespace dcplan::planner
