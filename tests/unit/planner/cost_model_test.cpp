// Tests of the calibration-curve cost model: interpolation, extrapolation, what-if scaling.
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>

#include "dcplan/planner/cost_model.h"

namespace dcplan::planner {
namespace {

schemas::Calibration linearCalibration(double latencyUs, double bytesPerUs) {
  schemas::Calibration c;
  for (uint64_t b = 1 << 16; b <= (1ull << 30); b *= 4) {
    c.allGather.push_back({b, latencyUs + static_cast<double>(b) / bytesPerUs});
  }
  return c;
}

TEST(CostModel, ReproducesMeasuredPoints) {
  schemas::Calibration c = linearCalibration(20, 100e3);
  CostModel m(c, 8);
  for (const auto& p : c.allGather) EXPECT_NEAR(m.us(Collective::AllGather, p.bytes), p.us, 1e-6 * p.us);
}

TEST(CostModel, IsMonotoneAndHasALatencyFloor) {
  CostModel m(linearCalibration(20, 100e3), 8);
  double prev = 0;
  for (uint64_t b = 1; b < (4ull << 30); b = b * 3 + 1) {
    double t = m.us(Collective::AllGather, b);
    EXPECT_GE(t, prev) << b;
    prev = t;
  }
  // Below the smallest point the time tends to the latency intercept.
  EXPECT_NEAR(m.us(Collective::AllGather, 1), 20, 0.5);
  EXPECT_NEAR(m.latencyUs(Collective::AllGather), 20, 1e-6);
  EXPECT_EQ(m.us(Collective::AllGather, 0), 0);
}

TEST(CostModel, APointSlowerThanALargerMessagesIsTakenAtTheLargersTime) {
  // Measured on 2 CPU ranks sharing 2 cores: 64 KiB in 3,513 us, 256 KiB in 458 us.
  schemas::Calibration c;
  c.allGather = {{64 << 10, 3513.0}, {256 << 10, 458.0}, {1 << 20, 1193.0}, {4 << 20, 4052.0}};
  CostModel m(c, 2);
  EXPECT_NEAR(m.us(Collective::AllGather, 64 << 10), 458.0, 1e-9);
  EXPECT_NEAR(m.us(Collective::AllGather, 256 << 10), 458.0, 1e-9);
  EXPECT_NEAR(m.us(Collective::AllGather, 1 << 20), 1193.0, 1e-9);  // the points that agree are kept
  EXPECT_LE(m.us(Collective::AllGather, 100 << 10), 458.0 * (1 + 1e-12));
}

TEST(CostModel, AnInSituScaleMultipliesEveryCollectivesTime) {
  const schemas::Calibration c = linearCalibration(20, 100e3);
  const CostModel plain(c, 8);
  CostModelOptions o;
  o.inSituScale = 2.5;
  const CostModel scaled(c, 8, o);
  for (uint64_t b : {uint64_t{1000}, uint64_t{1} << 20, uint64_t{3} << 30}) {
    EXPECT_NEAR(scaled.us(Collective::AllGather, b), 2.5 * plain.us(Collective::AllGather, b), 1e-9);
    EXPECT_NEAR(scaled.us(Collective::AllReduce, b), 2.5 * plain.us(Collective::AllReduce, b), 1e-9);
  }
  EXPECT_NEAR(scaled.latencyUs(Collective::AllGather), 50, 1e-6);
  EXPECT_NEAR(scaled.busGBps(Collective::AllGather), plain.busGBps(Collective::AllGather) / 2.5, 1e-9);
  o.inSituScale = 0;
  EXPECT_THROW(CostModel(c, 8, o), std::invalid_argument);
}

TEST(CostModel, ACudaGraphsPlanTakesTheDeviceTimesWhereEveryPointHasOne) {
  // Host-timed 20 us of latency; the same calls on the device alone 4 us less each.
  schemas::Calibration c = linearCalibration(20, 100e3);
  for (auto& p : c.allGather) p.deviceUs = p.us - 4;
  c.reduceScatter = c.allGather;
  CostModelOptions graph;
  graph.deviceQueued = true;
  const CostModel queued(c, 8, graph);
  const CostModel issued(c, 8);
  for (const auto& p : c.allGather) {
    EXPECT_NEAR(queued.us(Collective::AllGather, p.bytes), p.us - 4, 1e-6 * p.us);
    EXPECT_NEAR(queued.us(Collective::ReduceScatter, p.bytes), p.us - 4, 1e-6 * p.us);
    EXPECT_NEAR(issued.us(Collective::AllGather, p.bytes), p.us, 1e-6 * p.us);
  }
  EXPECT_NEAR(queued.latencyUs(Collective::AllGather), 16, 1e-6);
  auto says = [](const CostModel& m, const std::string& what) {
    const auto lines = m.describe();
    return std::any_of(lines.begin(), lines.end(), [&](const std::string& l) { return l.find(what) != l.npos; });
  };
  EXPECT_TRUE(says(queued, "(timed on the device, as a CUDA graph issues it)"));
  EXPECT_FALSE(says(issued, "timed on the device"));
  EXPECT_FALSE(says(issued, "host-timed"));
  EXPECT_EQ(queued.graphHostTimed(), "");
  EXPECT_EQ(issued.graphHostTimed(), "");
  // One rank's copies, from a one-rank trace, alike.
  const CostModel oneRank(c, 1, graph);
  EXPECT_NEAR(oneRank.us(Collective::AllGather, c.allGather[1].bytes), c.allGather[1].us - 4, 1e-6);

  // One point without (or at 0): the whole calibration is read host-timed, and --explain says so.
  for (auto lacking : {std::optional<double>(), std::optional<double>(0.0)}) {
    schemas::Calibration partial = c;
    partial.reduceScatter.back().deviceUs = lacking;
    const CostModel host(partial, 8, graph);
    for (const auto& p : c.allGather) {
      EXPECT_NEAR(host.us(Collective::AllGather, p.bytes), p.us, 1e-6 * p.us);
      EXPECT_NEAR(host.us(Collective::ReduceScatter, p.bytes), p.us, 1e-6 * p.us);
    }
    EXPECT_FALSE(says(host, "timed on the device, as"));
    EXPECT_TRUE(says(host, "collectives host-timed: calibration.reduce_scatter[" +
                               std::to_string(partial.reduceScatter.size() - 1) + "] has no device_us"));
    EXPECT_EQ(host.graphHostTimed().rfind("collectives host-timed: calibration.reduce_scatter[", 0), 0u);
  }
}

TEST(CostModel, ExtrapolatesWithTheLastBandwidth) {
  CostModel m(linearCalibration(20, 100e3), 8);
  double at1g = m.us(Collective::AllGather, 1ull << 30);
  double at4g = m.us(Collective::AllGather, 4ull << 30);
  EXPECT_NEAR(at4g - at1g, 3.0 * (1ull << 30) / 100e3, 1.0);
}

TEST(CostModel, MissingCurvesFallBackToAllGather) {
  CostModel m(linearCalibration(20, 100e3), 8);
  EXPECT_NEAR(m.us(Collective::ReduceScatter, 1 << 20), m.us(Collective::AllGather, 1 << 20), 1e-9);
  EXPECT_NEAR(m.us(Collective::AllReduce, 1 << 20), 2 * m.us(Collective::AllGather, 1 << 20), 1e-6);
}

TEST(CostModel, WorldSizeScalesTheBandwidthTermByTheBusFactor) {
  schemas::Calibration c = linearCalibration(20, 100e3);
  CostModel at8(c, 8);
  CostModel at16(c, 8, {16, std::nullopt, std::nullopt});
  CostModel at2(c, 8, {2, std::nullopt, std::nullopt});
  uint64_t b = 256ull << 20;
  double bw8 = at8.us(Collective::AllGather, b) - 20;
  EXPECT_NEAR(at16.us(Collective::AllGather, b) - 20, bw8 * (15.0 / 16) / (7.0 / 8), 1e-6 * bw8);
  EXPECT_NEAR(at2.us(Collective::AllGather, b) - 20, bw8 * (1.0 / 2) / (7.0 / 8), 1e-6 * bw8);
  CostModel at1(c, 8, {1, std::nullopt, std::nullopt});
  EXPECT_EQ(at1.us(Collective::AllGather, b), 0);
}

TEST(CostModel, BandwidthOverrideRescalesLargeMessages) {
  schemas::Calibration c = linearCalibration(20, 100e3);
  CostModel base(c, 8);
  double calibrated = base.busGBps(Collective::AllGather);
  EXPECT_NEAR(calibrated, 100.0 * 7 / 8, 0.5);  // 100e3 bytes/us = 100 GB/s algorithmic
  CostModel half(c, 8, {0, calibrated / 2, std::nullopt});
  uint64_t b = 1ull << 30;
  EXPECT_NEAR(half.us(Collective::AllGather, b) - 20, 2 * (base.us(Collective::AllGather, b) - 20), 1.0);
  EXPECT_NEAR(half.busGBps(Collective::AllGather), calibrated / 2, 1e-9);
}

TEST(CostModel, RefusesWhatItCannotKnow) {
  schemas::Calibration empty;
  EXPECT_THROW(CostModel(empty, 8), std::invalid_argument);
  EXPECT_THROW(CostModel(linearCalibration(20, 1e5), 1, {8, std::nullopt, std::nullopt}),
               std::invalid_argument);
  EXPECT_NO_THROW(CostModel(empty, 1));
}

TEST(CostModel, OneRankTimesTheCopiesItCalibratedOnOneRankOnly) {
  // On one rank the runtime still issues each gather and ZeRO-1's all-reduce (a copy on the
  // transport's stream); a one-rank trace timed them. A ZeRO-2/3 bucket is its own reduction
  // there (packed, no call), whatever the calibration timed of a reduce-scatter.
  const schemas::Calibration c = linearCalibration(20, 100e3);
  CostModel one(c, 1);
  EXPECT_NEAR(one.us(Collective::AllGather, 1 << 20), 20 + (1 << 20) / 100e3, 1e-6);
  EXPECT_NEAR(one.us(Collective::AllReduce, 1 << 20), 2 * (20 + (1 << 20) / 100e3), 1e-6);
  EXPECT_EQ(one.us(Collective::ReduceScatter, 1 << 20), 0);
  EXPECT_NEAR(one.latencyUs(Collective::AllGather), 20, 1e-6);
  EXPECT_EQ(one.us(Collective::AllGather, 0), 0);
  // Planning one rank from a trace of eight: nothing was timed at one rank, the calls are free.
  CostModel fromEight(c, 8, {1, std::nullopt, std::nullopt});
  EXPECT_EQ(fromEight.us(Collective::AllGather, 1 << 20), 0);
  EXPECT_EQ(fromEight.latencyUs(Collective::AllGather), 0);
  // A one-rank trace without a calibration: free as before.
  EXPECT_EQ(CostModel(schemas::Calibration{}, 1).us(Collective::AllGather, 1 << 20), 0);
}

TEST(CostModel, CopyRate) {
  schemas::Calibration c = linearCalibration(20, 100e3);
  c.h2dGBps = 50;
  CostModel m(c, 8);
  EXPECT_NEAR(m.copyUs(50'000'000, true), 1000, 1e-9);
  EXPECT_EQ(m.copyUs(50'000'000, false), 0);
}

}  // namespace
}  // namespace dcplan::planner
