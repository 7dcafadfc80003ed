// Element types (f32, f16, bf16, i32, u8) and round-to-nearest-even conversions between them.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace replica {

enum class DType : uint8_t { f32, f16, bf16, i32, u8 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
// Parses "f32|fp32|float32|f16|fp16|float16|bf16|bfloat16|i32|int32|u8|uint8".
DType parse_dtype(const std::string& s);

// IEEE binary16 stored as its 16 bits, so a CPU tensor of f16 behaves as on a GPU.
struct Half {
  uint16_t bits = 0;
};
// bfloat16: the top 16 bits of a float32.
struct BFloat16 {
  uint16_t bits = 0;
};

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float -> half with round-to-nearest-even; overflow gives inf, NaN stays NaN (quiet).
inline Half float_to_half(float f) {
  uint32_t x = float_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t exp = (x >> 23) & 0xffu;
  uint32_t man = x & 0x7fffffu;
  Half h;
  if (exp == 0xff) {  // inf or NaN
    h.bits = static_cast<uint16_t>(sign | 0x7c00u | (man ? 0x200u | (man >> 13) : 0u));
    return h;
  }
  int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 31) {  // overflow
    h.bits = static_cast<uint16_t>(sign | 0x7c00u);
    return h;
  }
  if (e <= 0) {  // subnormal or zero in half
    if (e < -10) {
      h.bits = static_cast<uint16_t>(sign);
      return h;
    }
    man |= 0x800000u;  // implicit bit
    int shift = 14 - e;  // 1 - e + 13
    uint32_t half_man = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_man & 1u))) half_man++;
    h.bits = static_cast<uint16_t>(sign | half_man);
    return h;
  }
  uint32_t half_man = man >> 13;
  uint32_t rem = man & 0x1fffu;
  uint32_t out = sign | (static_cast<uint32_t>(e) << 10) | half_man;
  if (rem > 0x1000u || (rem == 0x1000u && (half_man & 1u))) out++;  // may carry into exp: correct
  h.bits = static_cast<uint16_t>(out);
  return h;
}

inline float half_to_float(Half h) {
  uint32_t sign = (static_cast<uint32_t>(h.bits) & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t man = h.bits & 0x3ffu;
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    // subnormal: normalize
    int e = -1;
    do {
      man <<= 1;
      e++;
    } while ((man & 0x400u) == 0);
    man &= 0x3ffu;
    return bits_float(sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | (man << 13));
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (man << 13));
  return bits_float(sign | ((exp - 15 + 127) << 23) | (man << 13));
}

inline BFloat16 float_to_bf16(float f) {
  uint32_t x = float_bits(f);
  BFloat16 b;
  if ((x & 0x7f800000u) == 0x7f800000u && (x & 0x7fffffu)) {  // NaN: keep it quiet NaN
    b.bits = static_cast<uint16_t>((x >> 16) | 0x40u);
    return b;
  }
  uint32_t lsb = (x >> 16) & 1u;
  x += 0x7fffu + lsb;
  b.bits = static_cast<uint16_t>(x >> 16);
  return b;
}
inline float bf16_to_float(BFloat16 b) { return bits_float(static_cast<uint32_t>(b.bits) << 16); }

// v as it would be stored in a float dtype t (rounded to nearest even for f16 / bf16).
inline float round_to(float v, DType t) {
  if (t == DType::f16) return half_to_float(float_to_half(v));
  if (t == DType::bf16) return bf16_to_float(float_to_bf16(v));
  return v;
}

// Each of v[0..n) as it would be stored in t, in place: through the vectorised conversions, bit
// for bit the scalar round_to.
void round_to(float* v, size_t n, DType t);

// Element i of a buffer of dtype t, as a float.
float load_as_float(const void* p, DType t, size_t i);

// Converts n elements between any two dtypes (float types round to nearest even; ints truncate).
void convert(const void* src, DType src_type, void* dst, DType dst_type, size_t n);

}  // namespace replica
