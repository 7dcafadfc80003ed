// Byte sizes: the one parser (config keys and command-line flags) and the one printer.
#include <gtest/gtest.h>

#include "core/errors.h"
#include "core/units.h"

using namespace replica;

TEST(Units, ParsesBinaryDecimalAndShortSuffixes) {
  EXPECT_EQ(parse_bytes("512MiB", "x"), uint64_t(512) << 20);
  EXPECT_EQ(parse_bytes("128M", "x"), uint64_t(128) << 20);
  EXPECT_EQ(parse_bytes("1G", "x"), uint64_t(1) << 30);
  EXPECT_EQ(parse_bytes("8", "x"), 8u);
  EXPECT_EQ(parse_bytes("2 GB", "x"), 2000000000u);
  EXPECT_EQ(parse_bytes("1.5KiB", "x"), 1536u);
  EXPECT_THROW(parse_bytes("5 parsecs", "x"), ConfigError);
  EXPECT_THROW(parse_bytes("-1", "x"), ConfigError);
  try {
    parse_bytes("1e30GiB", "memory.bytes");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("memory.bytes"), std::string::npos);
  }
}

TEST(Units, PrintsTheLargestFittingUnit) {
  EXPECT_EQ(format_bytes(100), "100 B");
  EXPECT_EQ(format_bytes(1536), "1.5 KiB");
  EXPECT_EQ(format_bytes(size_t(3) << 20), "3.00 MiB");
  EXPECT_EQ(format_bytes(size_t(3) << 29), "1.50 GiB");
}
