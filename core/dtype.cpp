// DType names, sizes and bulk conversion.
#include "core/dtype.h"

#include <algorithm>
#include <cstring>

#include "core/errors.h"

#include "core/cpu_features.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define REPLICA_X86_DISPATCH 1
#endif

namespace replica {

#ifdef REPLICA_X86_DISPATCH
namespace {
// F16C with AVX, and allowed by REPLICA_CPU_ISA (baseline keeps every conversion scalar).
bool f16c_enabled() { return cpu_has_f16c() && cpu_isa_enabled(CpuIsa::avx2); }
// f16 <-> f32 by the F16C instructions, compiled for them whatever -march says and entered only
// when the CPU has them (core/cpu_features.h); the scalar loops below are the fallback and
// finish the tail. The hardware rounds to nearest even, as float_to_half does (tested).
__attribute__((target("avx,f16c"))) size_t f32_to_f16_f16c(const float* s, Half* d, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
  return i;
}
__attribute__((target("avx,f16c"))) size_t f16_to_f32_f16c(const Half* s, float* d, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  return i;
}
// f32 -> bf16, round to nearest even, NaN kept quiet: float_to_bf16's bits (tested on every
// pattern), 16 at a time. NaN is rare, so the blend that quiets it runs only for a block that
// has one (a compare and a movemask per block otherwise), which makes this loop about a third
// shorter than the one the compiler vectorises from the scalar code.
// One vector of 8 floats rounded to bf16 in the low half of each lane. A function with the target
// attribute of its own (a lambda would not inherit it, and a -march=x86-64-v2 build rejects it).
__attribute__((target("avx2"), always_inline)) inline __m256i round_bf16_avx2(__m256i x) {
  const __m256i hi = _mm256_srli_epi32(x, 16);
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), _mm256_and_si256(hi, _mm256_set1_epi32(1))),
      16);
  const __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  if (!_mm256_testz_si256(nan, nan)) r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
  return r;
}
__attribute__((target("avx2"))) size_t f32_to_bf16_avx2(const char* s, char* d, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i a = round_bf16_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 4 * i)));
    const __m256i b = round_bf16_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 4 * i + 32)));
    // packus works per 128-bit lane: a0 b0 a1 b1 -> a0 a1 b0 b1
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 2 * i), packed);
  }
  return i;
}
// bf16 -> f32: each 16-bit pattern becomes the high half of a float, 8 at a time, widened
// straight from memory (the compiler's loop loaded 16 and split them with an extract).
__attribute__((target("avx2"))) size_t bf16_to_f32_avx2(const char* s, char* d, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 4 * i), _mm256_slli_epi32(w, 16));
  }
  return i;
}
}  // namespace
#endif

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::f16:
    case DType::bf16:
      return 2;
    case DType::u8:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::u8: return "u8";
  }
  return "?";
}

DType parse_dtype(const std::string& s) {
  if (s == "f32" || s == "fp32" || s == "float32") return DType::f32;
  if (s == "f16" || s == "fp16" || s == "float16") return DType::f16;
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  if (s == "i32" || s == "int32") return DType::i32;
  if (s == "u8" || s == "uint8") return DType::u8;
  throw ConfigError("unknown dtype '" + s + "'; use fp32, fp16, bf16, i32 or u8");
}

float load_as_float(const void* p, DType t, size_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f16: return half_to_float(static_cast<const Half*>(p)[i]);
    case DType::bf16: return bf16_to_float(static_cast<const BFloat16*>(p)[i]);
    case DType::i32: return static_cast<float>(static_cast<const int32_t*>(p)[i]);
    case DType::u8: return static_cast<float>(static_cast<const uint8_t*>(p)[i]);
  }
  return 0.f;
}

namespace {
void store(void* p, DType t, size_t i, float v) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = v; break;
    case DType::f16: static_cast<Half*>(p)[i] = float_to_half(v); break;
    case DType::bf16: static_cast<BFloat16*>(p)[i] = float_to_bf16(v); break;
    case DType::i32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DType::u8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v); break;
  }
}
}  // namespace

void round_to(float* v, size_t n, DType t) {
  if (t != DType::f16 && t != DType::bf16) return;
  constexpr size_t kBlock = 512;
  uint16_t wire[kBlock];
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t m = std::min(kBlock, n - b);
    convert(v + b, DType::f32, wire, t, m);
    convert(wire, t, v + b, DType::f32, m);
  }
}

void convert(const void* src, DType st, void* dst, DType dt, size_t n) {
  if (st == dt) {
    std::memcpy(dst, src, n * dtype_size(st));
    return;
  }
  if (st == DType::f32 && dt == DType::f16) {
    auto* s = static_cast<const float*>(src);
    auto* d = static_cast<Half*>(dst);
    size_t i = 0;
#ifdef REPLICA_X86_DISPATCH
    if (f16c_enabled()) i = f32_to_f16_f16c(s, d, n);
#endif
    for (; i < n; ++i) d[i] = float_to_half(s[i]);
    return;
  }
  if (st == DType::f16 && dt == DType::f32) {
    auto* s = static_cast<const Half*>(src);
    auto* d = static_cast<float*>(dst);
    size_t i = 0;
#ifdef REPLICA_X86_DISPATCH
    if (f16c_enabled()) i = f16_to_f32_f16c(s, d, n);
#endif
    for (; i < n; ++i) d[i] = half_to_float(s[i]);
    return;
  }
  if (st == DType::f32 && dt == DType::bf16) {
    // float_to_bf16 without its branch, so the loop vectorises (the same bits: tested).
    auto* s = static_cast<const char*>(src);
    auto* d = static_cast<char*>(dst);
    size_t i = 0;
#ifdef REPLICA_X86_DISPATCH
    if (cpu_isa_enabled(CpuIsa::avx2)) i = f32_to_bf16_avx2(s, d, n);
#endif
    for (; i < n; ++i) {
      uint32_t x;
      std::memcpy(&x, s + 4 * i, 4);
      const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
      const uint32_t quiet = (x >> 16) | 0x40u;
      const uint16_t b = static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
      std::memcpy(d + 2 * i, &b, 2);
    }
    return;
  }
  if (st == DType::bf16 && dt == DType::f32) {
    auto* s = static_cast<const char*>(src);
    auto* d = static_cast<char*>(dst);
    size_t i = 0;
#ifdef REPLICA_X86_DISPATCH
    if (cpu_isa_enabled(CpuIsa::avx2)) i = bf16_to_f32_avx2(s, d, n);
#endif
    for (; i < n; ++i) {  // bf16_to_float, vectorised
      uint16_t b;
      std::memcpy(&b, s + 2 * i, 2);
      const uint32_t x = static_cast<uint32_t>(b) << 16;
      std::memcpy(d + 4 * i, &x, 4);
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) store(dst, dt, i, load_as_float(src, st, i));
}

}  // namespace replica
