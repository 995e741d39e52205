// Collective and copy times interpolated from a trace's calibration curves.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dcplan/schemas/trace.h"

namespace dcplan::planner {

enum class Collective { AllGather, ReduceScatter, AllReduce };

const char* collectiveName(Collective c);

/// Host time the runtime spends issuing one collective (a gather group or a bucket
/// flush): dispatch, buffer allocation, dtype conversion, events and the NCCL launch. The
/// recorded compute already holds this cost for the collectives the recorded run issued; a
/// schedule that issues more is charged this much per extra call. On 2xH200 a plan issuing
/// 169 more collectives than another ran 26 ms longer (docs/benchmarks.md); this is the
/// host's part of that, as a conservative default.
inline constexpr double kDefaultLaunchUs = 40.0;

/// What-if settings: the cluster to plan for when it is not the one traced.
struct CostModelOptions {
  int64_t worldSize = 0;                   ///< 0: the trace's world size
  std::optional<double> busBandwidthGBps;  ///< large-message bus bandwidth; absent: as calibrated
  std::optional<double> launchUs;          ///< host time per collective; absent: kDefaultLaunchUs
  /// launchUs was measured from the trace's host times (measuredLaunchUs): it holds on one
  /// rank too, where the runtime still copies and casts what a gather would move.
  bool launchMeasured = false;
  /// Every collective's time is this many times the calibration's: how the recorded run's own
  /// collectives ran against it (fitInSitu; CPU ranks only). 1: as calibrated.
  double inSituScale = 1.0;
  /// The replay checks each collective with the ranks first (trace meta.checks_collectives): one
  /// more small all-gather per call, which the recording ran without (checkUs).
  bool agreementChecks = false;
  /// The step runs in one CUDA graph, which issues its collectives without the host: the curves
  /// take their points' device_us (timed on the device behind queued work) where every point of
  /// every curve has one, else their host-timed us.
  bool deviceQueued = false;
};

/// The bytes each rank contributes to a collective's agreement check (the runtime's description of
/// the collective: its kind, op, place and sizes; replayer/src/CollectiveCheck.cpp).
inline constexpr uint64_t kAgreementCheckBytes = 136;

/// Time of a collective as a function of its full (unsharded) message size.
///
/// Each curve is interpolated linearly in (log bytes, log us) between measured
/// points, so that both the latency-bound and the bandwidth-bound ends keep their
/// shape. A point slower than a larger message's is noise (a shared host's scheduler: 3.5 ms for
/// 64 KiB against 0.46 ms for 256 KiB on 2 CPU ranks) and is taken at the larger one's time. Below the
/// smallest point the time falls linearly to the latency intercept of the first two points; above the largest
/// it grows with the marginal bandwidth of the last segment. On one rank a trace recorded on one rank gives
/// the curves of the transport's copies, unscaled. A different world size scales the bandwidth term by the
/// ring bus factor ((N-1)/N against the traced one); a different bus bandwidth scales it by calibrated/asked.
/// The latency term is kept: it is dominated by launch and synchronisation cost, not by ring length.
/// A CUDA graph's plan (CostModelOptions::deviceQueued) reads the points' device times instead.
class CostModel {
 public:
  /// Throws std::invalid_argument when the calibration cannot support the request
  /// (no all-gather points, or a 1-rank trace asked to plan for more ranks).
  CostModel(const schemas::Calibration& calibration, int64_t traceWorldSize,
            const CostModelOptions& options = {});

  /// Microseconds for one call moving `fullBytes`. One rank: the calibrated copy where the trace
  /// was recorded on one rank (the runtime still issues the call), else 0.
  double us(Collective c, uint64_t fullBytes) const;
  double latencyUs(Collective c) const;
  /// Bus bandwidth of large messages after re-scaling, GB/s (0 when unknown).
  double busGBps(Collective c) const;
  /// Host time to issue one collective (see kDefaultLaunchUs); with one rank 0 unless measured.
  double launchUs() const { return worldSize_ <= 1 && !launchMeasured_ ? 0 : launchUs_; }
  /// Host time of one collective's agreement check (CostModelOptions::agreementChecks): a blocking
  /// all-gather of kAgreementCheckBytes from every rank; 0 without. onUse: before a gather the
  /// compute waits for at once, as calibrated (the wait for the other ranks moves from the gather
  /// into the check); before a call the host does not wait for (a prefetch, a bucket), in situ
  /// (the wait for the other ranks is the check's own: they no longer run apart).
  double checkUs(bool onUse) const;
  /// The replay makes agreement checks the recording did not: its default schedule is simulated
  /// twice, as recorded (the reference of every launch charge) and as replayed.
  bool replayChecks() const { return agreementChecks_ && !callsFree(); }
  /// Host<->device copy time; 0 when the trace has no copy rate.
  double copyUs(uint64_t bytes, bool hostToDevice) const;
  /// The trace measured the host link both ways (calibration h2d_gbps, d2h_gbps).
  bool copyRated() const { return h2dGBps_.has_value() && d2hGBps_.has_value(); }

  int64_t worldSize() const { return worldSize_; }
  double inSituScale() const { return inSitu_; }
  int64_t traceWorldSize() const { return traceWorldSize_; }

  /// A plan for a CUDA graph (CostModelOptions::deviceQueued) whose calibration lacks a device time:
  /// what that costs its prediction, naming the first point without, for --explain and the plan's
  /// warnings; "" otherwise.
  std::string graphHostTimed() const;

  /// One line per collective, for --explain.
  std::vector<std::string> describe() const;

 private:
  struct Curve {
    std::vector<double> logBytes;
    std::vector<double> logUs;
    std::vector<double> bytes;
    std::vector<double> usec;
    double latencyUs = 0;
    double tailBytesPerUs = 0;  ///< marginal bandwidth above the largest point
    double calibratedBusGBps = 0;
    double scale = 1;           ///< applied to the bandwidth term
    double plannedBusGBps = 0;  ///< bus bandwidth of large messages after re-scaling
  };

  /// `deviceTimed`: from the points' device_us (every one has it).
  static Curve buildCurve(const std::vector<schemas::CalibrationPoint>& points, double traceBusFactor,
                          bool deviceTimed);
  static double rawUs(const Curve& curve, double bytes);
  /// Curves not measured, from the all-gather's (which must be there).
  void standInMissingCurves();
  const Curve& curve(Collective c) const;
  /// One rank without a one-rank trace's copies: every call takes no time.
  bool callsFree() const { return worldSize_ <= 1 && !oneRankCopies_; }

  int64_t traceWorldSize_;
  int64_t worldSize_;
  Curve allGather_;
  Curve reduceScatter_;
  Curve allReduce_;
  double launchUs_ = kDefaultLaunchUs;
  bool launchMeasured_ = false;
  double inSitu_ = 1.0;         ///< CostModelOptions::inSituScale
  bool agreementChecks_ = false;  ///< CostModelOptions::agreementChecks
  bool oneRankCopies_ = false;  ///< one rank, from a one-rank trace: the calibrated copies
  /// deviceQueued asked, but this calibration point has no device time ("all_reduce[7]"); else "".
  std::string hostTimedPoint_;
  bool deviceTimed_ = false;  ///< every curve is the points' device_us (deviceQueued, none lacking)
  std::optional<double> h2dGBps_;
  std::optional<double> d2hGBps_;
};

}  // namespace dcplan::planner
