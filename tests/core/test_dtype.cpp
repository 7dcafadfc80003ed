// DType conversions: round-to-nearest-even at the edges (max finite, overflow, subnormals, NaN).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/errors.h"

using namespace replica;

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::f16), 2u);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::u8), 1u);
  EXPECT_EQ(parse_dtype("fp16"), DType::f16);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::bf16);
  EXPECT_THROW(parse_dtype("fp8"), ConfigError);
}

TEST(DType, HalfExactValuesRoundTrip) {
  for (float f : {0.f, -0.f, 1.f, -2.5f, 0.099975586f, 65504.f, -65504.f, 6.103515625e-05f})
    EXPECT_EQ(half_to_float(float_to_half(f)), f) << f;
}

TEST(DType, HalfEdges) {
  EXPECT_EQ(float_to_half(65504.f).bits, 0x7bffu);        // max finite
  EXPECT_EQ(float_to_half(65520.f).bits, 0x7c00u);        // halfway to 2^16 rounds to inf
  EXPECT_EQ(float_to_half(65519.f).bits, 0x7bffu);        // below halfway stays finite
  EXPECT_EQ(float_to_half(1e6f).bits, 0x7c00u);           // overflow
  EXPECT_EQ(float_to_half(-1e6f).bits, 0xfc00u);
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::infinity()).bits, 0x7c00u);
  Half nan = float_to_half(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(half_to_float(nan)));
  EXPECT_EQ(nan.bits & 0x7c00u, 0x7c00u);
  // smallest subnormal 2^-24, and values around it
  EXPECT_EQ(float_to_half(5.9604645e-08f).bits, 0x0001u);
  EXPECT_EQ(half_to_float(Half{0x0001}), 5.9604645e-08f);
  EXPECT_EQ(float_to_half(2.9802322e-08f).bits, 0x0000u);  // exactly half of it: ties to even (0)
  EXPECT_EQ(float_to_half(4.5e-08f).bits, 0x0001u);        // above the tie rounds up
  EXPECT_EQ(float_to_half(8.940697e-08f).bits, 0x0002u);   // 1.5 * 2^-24 ties to even (2)
  EXPECT_EQ(half_to_float(Half{0x03ff}), 6.097555e-05f);   // largest subnormal
  EXPECT_EQ(float_to_half(6.097555e-05f).bits, 0x03ffu);
  // ties to even in the normal range: 1 + 2^-11 is halfway between 1 and 1 + 2^-10
  EXPECT_EQ(float_to_half(1.00048828125f).bits, 0x3c00u);
  EXPECT_EQ(float_to_half(1.00146484375f).bits, 0x3c02u);  // 1 + 3*2^-11: ties up to even
}

TEST(DType, BFloat16Edges) {
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.f)), 1.f);
  EXPECT_EQ(float_to_bf16(3.3895314e38f).bits, 0x7f7fu);  // max finite
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()).bits, 0x7f80u);  // rounds to inf
  EXPECT_EQ(float_to_bf16(1.00390625f).bits, 0x3f80u);    // 1 + 2^-8: tie, to even (1.0)
  EXPECT_EQ(float_to_bf16(1.01171875f).bits, 0x3f82u);    // 1 + 3*2^-8: tie, up to even
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  EXPECT_EQ(float_to_bf16(1e-39f).bits, 0x000bu);         // subnormals keep their top bits
}

TEST(DType, BulkConvert) {
  float src[4] = {1.f, -3.f, 65504.f, 1e9f};
  Half h[4];
  float back[4];
  convert(src, DType::f32, h, DType::f16, 4);
  convert(h, DType::f16, back, DType::f32, 4);
  EXPECT_EQ(back[0], 1.f);
  EXPECT_EQ(back[1], -3.f);
  EXPECT_EQ(back[2], 65504.f);
  EXPECT_TRUE(std::isinf(back[3]));
  BFloat16 b[4];
  convert(h, DType::f16, b, DType::bf16, 4);
  EXPECT_EQ(bf16_to_float(b[1]), -3.f);
}

// convert()'s vectorised bf16 loops give float_to_bf16's and bf16_to_float's bits exactly: every
// bf16 pattern back and forth, and floats around every rounding case (ties, NaN, inf, subnormal).
// The array round_to (the communicators' rounding after every 16-bit addition) gives the scalar
// round_to's bits for every element: random floats of all magnitudes, infinities, NaN, values
// between representable ones, past one 512-element block, from an unaligned start.
TEST(DType, ArrayRoundToMatchesTheScalarOne) {
  std::mt19937 rng(7);
  std::vector<float> v(1300);
  for (auto& x : v) {
    uint32_t bits = rng();
    std::memcpy(&x, &bits, sizeof x);
  }
  v[3] = std::numeric_limits<float>::infinity();
  v[4] = -std::numeric_limits<float>::infinity();
  v[5] = std::numeric_limits<float>::quiet_NaN();
  v[6] = 1.f + 1.f / 4096;  // between f16 and bf16 neighbours
  v[7] = 65520.f;           // rounds to f16 infinity
  for (DType t : {DType::f16, DType::bf16, DType::f32}) {
    std::vector<float> got(v.begin() + 1, v.end());
    round_to(got.data(), got.size(), t);
    for (size_t i = 0; i < got.size(); ++i) {
      const float want = round_to(v[i + 1], t);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got[i])) << dtype_name(t) << " i=" << i;
        continue;
      }
      uint32_t a, b;
      std::memcpy(&a, &got[i], 4);
      std::memcpy(&b, &want, 4);
      ASSERT_EQ(a, b) << dtype_name(t) << " i=" << i << " v=" << v[i + 1];
    }
  }
}

TEST(DType, ConvertBf16MatchesTheScalarConversions) {
  std::vector<float> f;
  std::mt19937 rng(5);
  for (uint32_t hi = 0; hi < 0x10000u; ++hi)
    for (uint32_t lo : {0u, 1u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, static_cast<uint32_t>(rng() & 0xffffu)}) {
      const uint32_t bits = hi << 16 | lo;
      float v;
      std::memcpy(&v, &bits, 4);
      f.push_back(v);
    }
  std::vector<uint16_t> b(f.size());
  convert(f.data(), DType::f32, b.data(), DType::bf16, f.size());
  size_t bad = 0;
  for (size_t i = 0; i < f.size(); ++i) bad += b[i] != float_to_bf16(f[i]).bits;
  EXPECT_EQ(bad, 0u) << "f32 -> bf16";
  // Unaligned starts and lengths that leave a tail for the scalar loop after the vector one.
  for (size_t off : {1u, 3u, 17u})
    for (size_t len : {5u, 15u, 16u, 33u, 1001u}) {
      std::vector<uint16_t> part(len);
      convert(f.data() + off * 4099, DType::f32, part.data(), DType::bf16, len);
      for (size_t i = 0; i < len; ++i) bad += part[i] != float_to_bf16(f[off * 4099 + i]).bits;
    }
  EXPECT_EQ(bad, 0u) << "f32 -> bf16, unaligned with a tail";
  std::vector<uint16_t> all(0x10000);
  for (uint32_t i = 0; i < 0x10000u; ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> back(all.size());
  convert(all.data(), DType::bf16, back.data(), DType::f32, all.size());
  bad = 0;
  for (uint32_t i = 0; i < 0x10000u; ++i) {
    const float want = bf16_to_float(BFloat16{static_cast<uint16_t>(i)});
    bad += std::memcmp(&back[i], &want, 4) != 0;
  }
  EXPECT_EQ(bad, 0u) << "bf16 -> f32";
  for (size_t off : {1u, 5u})
    for (size_t len : {3u, 7u, 8u, 17u, 1001u}) {
      std::vector<float> part(len);
      convert(all.data() + off * 4099, DType::bf16, part.data(), DType::f32, len);
      bad += std::memcmp(part.data(), back.data() + off * 4099, len * 4) != 0;
    }
  EXPECT_EQ(bad, 0u) << "bf16 -> f32, unaligned with a tail";
}
