// The reduction kernels: sums in rank order, fp32 accumulation, rounding, aliasing.
#include "dcplan/shm/ShmComm.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace dcplan::shm {
namespace {

uint16_t bf16Bits(float f) { return static_cast<uint16_t>(std::bit_cast<uint32_t>(f) >> 16); }
float bf16Value(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

TEST(ReduceSum, Float32AddsInRankOrder) {
  // (1e8 + 1) + -1e8 is 0 in fp32, 1e8 + (1 + -1e8) is 8: the order is part of the result.
  std::vector<float> a{1e8f, 1.0f}, b{1.0f, 2.0f}, c{-1e8f, 3.0f}, out(2);
  const void* ins[] = {a.data(), b.data(), c.data()};
  reduceSum(DType::Float32, out.data(), ins, 3, 2);
  EXPECT_EQ(out[0], (1e8f + 1.0f) + -1e8f);
  EXPECT_EQ(out[1], 6.0f);
}

TEST(ReduceSum, BFloat16AccumulatesInFloat32AndRoundsOnce) {
  // 256 + 1 + 1: bf16 has 8 bits of mantissa, so adding 1 twice in bf16 would stay at 256;
  // in fp32 the sum is 258, which rounds (to nearest even) to 258 in bf16.
  std::vector<uint16_t> a(1000, bf16Bits(256.0f)), b(1000, bf16Bits(1.0f)), c(1000, bf16Bits(1.0f)),
      out(1000);
  const void* ins[] = {a.data(), b.data(), c.data()};
  reduceSum(DType::BFloat16, out.data(), ins, 3, out.size());
  for (uint16_t v : out) ASSERT_EQ(bf16Value(v), 258.0f);
}

TEST(ReduceSum, BFloat16RoundsToNearestEvenAndKeepsNaN) {
  // 1 + 2^-8 lies halfway between bf16 neighbours 1 and 1 + 2^-7: to even is 1.
  std::vector<uint16_t> a{bf16Bits(1.0f), 0x7fc0, bf16Bits(1.0f)};
  std::vector<uint16_t> b{bf16Bits(0.00390625f), bf16Bits(1.0f), bf16Bits(0.009765625f)}, out(3);
  const void* ins[] = {a.data(), b.data()};
  reduceSum(DType::BFloat16, out.data(), ins, 2, 3);
  EXPECT_EQ(bf16Value(out[0]), 1.0f);
  EXPECT_TRUE(std::isnan(bf16Value(out[1])));
  EXPECT_EQ(bf16Value(out[2]), 1.0f + 0.0078125f);  // 1 + 1.25 * 2^-7 rounds to 1 + 2^-7
}

TEST(ReduceSum, Float16AccumulatesInFloat32) {
  std::vector<_Float16> a(33, static_cast<_Float16>(2048.0f)), b(33, static_cast<_Float16>(1.0f)), out(33);
  std::vector<_Float16> c = b;
  const void* ins[] = {a.data(), b.data(), c.data()};
  reduceSum(DType::Float16, out.data(), ins, 3, out.size());
  for (_Float16 v : out) ASSERT_EQ(static_cast<float>(v), 2050.0f);
}

TEST(ReduceSum, OutputMayBeAnInput) {
  for (size_t n : {1u, 511u, 512u, 513u, 4099u}) {
    std::vector<float> a(n), b(n);
    for (size_t i = 0; i < n; ++i) {
      a[i] = static_cast<float>(i);
      b[i] = 0.5f * static_cast<float>(i);
    }
    const void* ins[] = {a.data(), b.data()};
    reduceSum(DType::Float32, b.data(), ins, 2, n);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(b[i], 1.5f * static_cast<float>(i)) << "n=" << n << " i=" << i;
  }
}

}  // namespace
}  // namespace dcplan::shm
