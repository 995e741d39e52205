// Tests of option parsing and number formats.
#include <gtest/gtest.h>

#include <stdexcept>

#include "dcplan/planner/units.h"

namespace dcplan::planner {
namespace {

TEST(Units, ByteSizes) {
  EXPECT_EQ(parseByteSize("40GiB"), 40ull << 30);
  EXPECT_EQ(parseByteSize(" 512 MiB "), 512ull << 20);
  EXPECT_EQ(parseByteSize("1.5e9"), 1500000000ull);
  EXPECT_EQ(parseByteSize("80GB"), 80000000000ull);
}

TEST(Units, ByteSizeErrorsSayWhatIsExpected) {
  for (const char* bad : {"", "GiB", "40 parsecs", "-1GiB", "lots"}) {
    try {
      parseByteSize(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("is not a size"), std::string::npos) << e.what();
    }
  }
}

TEST(Units, Bandwidth) {
  EXPECT_EQ(parseBandwidthGBps("200"), 200);
  EXPECT_EQ(parseBandwidthGBps("25.5GB/s"), 25.5);
  EXPECT_EQ(parseBandwidthGBps("100 GBps"), 100);
  EXPECT_THROW(parseBandwidthGBps("0"), std::invalid_argument);
  EXPECT_THROW(parseBandwidthGBps("100Mbps"), std::invalid_argument);
  EXPECT_THROW(parseBandwidthGBps("fast"), std::invalid_argument);
  EXPECT_THROW(parseBandwidthGBps("inf"), std::invalid_argument);
}

TEST(Units, Formats) {
  EXPECT_EQ(formatFixed(-0.0001, 1), "0.0");
  EXPECT_EQ(formatFixed(12.345, 2), "12.35");
  EXPECT_EQ(formatChange(100, 80), "-20.0%");
  EXPECT_EQ(formatChange(100, 125), "+25.0%");
  EXPECT_EQ(formatChange(0, 0), "+0.0%");
  EXPECT_EQ(formatChange(0, 3), "n/a");
}

}  // namespace
}  // namespace dcplan::planner
