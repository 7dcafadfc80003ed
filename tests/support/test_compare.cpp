// The comparison helpers every equivalence and golden test relies on: a non-finite value on one
// side only is never "close", whatever the tolerance.
#include <gtest/gtest.h>

#include <limits>

#include "support/compare.h"

using replica::testing::max_rel_diff;

TEST(Compare, NonFiniteOnOneSideIsNeverClose) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<float> ref = {1.f, -2.f, 3.f};
  EXPECT_EQ(max_rel_diff(ref, ref), 0.0);
  EXPECT_NEAR(max_rel_diff({1.f, -2.f, 3.03f}, ref), 0.01, 1e-6) << "relative to the largest reference value";
  EXPECT_FALSE(max_rel_diff({nan, nan, nan}, ref) < 1.0) << "an all-NaN result";
  EXPECT_FALSE(max_rel_diff({1.f, inf, 3.f}, ref) < 1.0) << "an inf where the reference is finite";
  EXPECT_FALSE(max_rel_diff(ref, {1.f, nan, 3.f}) < 1.0) << "a NaN in the reference only";
  EXPECT_FALSE(max_rel_diff({1.f, -2.f}, ref) < 1.0) << "sizes differ";
  EXPECT_FALSE(max_rel_diff({inf, 1.f}, {-inf, 1.f}) < 1.0) << "inf of the other sign";
  EXPECT_FALSE(max_rel_diff({nan, 1.f}, {inf, 1.f}) < 1.0) << "NaN where inf is expected";
  EXPECT_EQ(max_rel_diff({inf, 1.f}, {inf, 1.f}), 0.0) << "an expected inf matches";
  EXPECT_TRUE(replica::testing::all_finite(ref));
  EXPECT_FALSE(replica::testing::all_finite({1.f, nan}));
}
