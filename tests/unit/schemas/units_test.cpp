// Sizes and times as people write and read them.
#include <gtest/gtest.h>

#include "dcplan/schemas/dtype.h"
#include "dcplan/schemas/units.h"

namespace dcplan::schemas {
namespace {

TEST(Units, ParsesSizes) {
  EXPECT_EQ(parseByteSize("40GiB"), 40ull << 30);
  EXPECT_EQ(parseByteSize("512 MiB"), 512ull << 20);
  EXPECT_EQ(parseByteSize("1.5GB"), 1500000000ull);
  EXPECT_EQ(parseByteSize("1e9"), 1000000000ull);
  EXPECT_EQ(parseByteSize("800000"), 800000ull);
  EXPECT_EQ(parseByteSize("2kib"), 2048ull);
  EXPECT_EQ(parseByteSize("70G"), 70000000000ull);
  EXPECT_EQ(parseByteSize("0"), 0ull);
}

TEST(Units, RefusesWhatIsNotASize) {
  for (const char* bad : {"", "GiB", "-1GiB", "12 parsecs", "1.5.5G", "nan", "inf", "1e40"}) {
    EXPECT_FALSE(parseByteSize(bad).has_value()) << bad;
  }
}

TEST(Units, FormatsBytes) {
  EXPECT_EQ(formatBytes(0), "0 B");
  EXPECT_EQ(formatBytes(1023), "1023 B");
  EXPECT_EQ(formatBytes(1536), "1.50 KiB");
  EXPECT_EQ(formatBytes(247ull << 20), "247 MiB");
  EXPECT_EQ(formatBytes(70ull << 30), "70.0 GiB");
}

TEST(Units, FormatsMilliseconds) {
  EXPECT_EQ(formatMs(12345.4), "12.345 ms");
  EXPECT_EQ(formatMs(0), "0.000 ms");
}

TEST(Dtype, Sizes) {
  EXPECT_EQ(dtypeSize("float32"), 4);
  EXPECT_EQ(dtypeSize("bfloat16"), 2);
  EXPECT_EQ(dtypeSize("float8_e4m3fn"), 1);
  EXPECT_FALSE(dtypeSize("torch.float32").has_value());
}

}  // namespace
}  // namespace dcplan::schemas
