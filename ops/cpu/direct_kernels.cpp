// The direct convolution kernels of one CPU kernel copy (see direct_kernels.h), compiled once per
// level with the copy's -march (ops/CMakeLists.txt).
#include "ops/cpu/direct_kernels.h"

#include <algorithm>
#include <type_traits>

#include "core/errors.h"
#include "ops/cpu/direct_conv.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace replica::ops::REPLICA_CPU_ISA_NS::direct_kernels {

#if defined(__AVX2__) && defined(__FMA__)
namespace {

// Every kernel below is forced inline into its caller: GCC 12 left block<6, 2> out of line in the
// avx512 copy, where its 12 accumulators were stored to the stack every channel step (forward
// 2x slower); inlined, they stay in registers across the whole (r, s, c) loop.
#define KERNEL inline __attribute__((always_inline))

struct Taps {
  int64_t C, K, R, S, row;  // row: floats from one padded input row to the next
};

// NB output pixels x KV vectors of 8 output channels, summed over R x S x C. base[i]: pixel i's
// top-left tap in the padded input; w: the filter's first output channel of this block.
template <int NB, int KV>
KERNEL void block(const float* const* base, const float* w, const Taps& t,
                                                float* const* out) {
  __m256 acc[NB][KV];
  for (int i = 0; i < NB; ++i)
    for (int v = 0; v < KV; ++v) acc[i][v] = _mm256_setzero_ps();
  for (int64_t r = 0; r < t.R; ++r) {
    for (int64_t s = 0; s < t.S; ++s) {
      const int64_t off = r * t.row + s * t.C;
      const float* wp = w + (r * t.S + s) * t.C * 8 * KV;  // this block's filter (pack_blocks)
      for (int64_t c = 0; c < t.C; ++c, wp += 8 * KV) {
        __m256 wv[KV];
        for (int v = 0; v < KV; ++v) wv[v] = _mm256_loadu_ps(wp + 8 * v);
        for (int i = 0; i < NB; ++i) {
          const __m256 b = _mm256_broadcast_ss(base[i] + off + c);
          for (int v = 0; v < KV; ++v) acc[i][v] = _mm256_fmadd_ps(b, wv[v], acc[i][v]);
        }
      }
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int v = 0; v < KV; ++v) _mm256_storeu_ps(out[i] + 8 * v, acc[i][v]);
}

constexpr int kPixels = 6;  // 6 x 2 accumulators + 2 filter vectors + 1 broadcast: 15 of 16 ymm
// The weight gradient's band of output rows (dy rows plus the input rows they read), in bytes.
constexpr int64_t kBandBytes = int64_t(128) << 10;

// Weight gradient of NB filter taps (off[i]: tap i's offset from a pixel's top-left tap) x KV
// vectors of output channels, accumulated in registers over every pixel of one image.
template <int NB, int KV>
KERNEL void filter_block(const float* xpad, const int64_t* off, const float* dy,
                                                       const Taps& t, int64_t stride, int64_t P, int64_t Q,
                                                       float* const* dw) {
  __m256 acc[NB][KV];
  for (int i = 0; i < NB; ++i)
    for (int v = 0; v < KV; ++v) acc[i][v] = _mm256_loadu_ps(dw[i] + 8 * v);
  for (int64_t p = 0; p < P; ++p) {
    const float* x = xpad + p * stride * t.row;
    const float* d = dy + p * Q * t.K;
    for (int64_t q = 0; q < Q; ++q, x += stride * t.C, d += t.K) {
      __m256 dv[KV];
      for (int v = 0; v < KV; ++v) dv[v] = _mm256_loadu_ps(d + 8 * v);
      for (int i = 0; i < NB; ++i) {
        const __m256 b = _mm256_broadcast_ss(x + off[i]);
        for (int v = 0; v < KV; ++v) acc[i][v] = _mm256_fmadd_ps(b, dv[v], acc[i][v]);
      }
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int v = 0; v < KV; ++v) _mm256_storeu_ps(dw[i] + 8 * v, acc[i][v]);
}

template <int NB>
KERNEL void filter_taps(const float* xpad, const int64_t* off, const float* dy, const Taps& t, int64_t stride, int64_t P,
                 int64_t Q, float* const* dw) {
  int64_t k = 0;
  float* o[NB];
  for (; k + 16 <= t.K; k += 16) {
    for (int i = 0; i < NB; ++i) o[i] = dw[i] + k;
    filter_block<NB, 2>(xpad, off, dy + k, t, stride, P, Q, o);
  }
  if (k < t.K) {
    for (int i = 0; i < NB; ++i) o[i] = dw[i] + k;
    filter_block<NB, 1>(xpad, off, dy + k, t, stride, P, Q, o);
  }
}

// Calls f(std::integral_constant<int, NB>{}) for a run-time nb in 1..Max: the tails of the tiles.
template <int Max, typename F>
void with_nb(int nb, F&& f) {
  if constexpr (Max > 1) {
    if (nb < Max) return with_nb<Max - 1>(nb, f);
  }
  f(std::integral_constant<int, Max>{});
}

constexpr int kPixels512 = 12;  // 12 x 2 accumulators + 2 filter vectors + 1 broadcast: 27 of 32 zmm

#if defined(__AVX512F__)
// The avx512 copy's zmm kernels (REPLICA_DIRECT_ZMM=1, direct_conv.h): the same sums in 512-bit
// registers, 16 output channels a vector, twice the pixels (or taps) per tile in the 32 zmm
// registers. Each output element gets the same FMAs in the same order as in the AVX2 kernels
// above (the same bits); a last block of 8 channels keeps the AVX2 kernels. Off by default: on
// a Zen 4 EPYC (512-bit FMAs issued as two 256-bit halves) they were 0.94x the AVX2 kernels on
// ResNet-20 and ResNet-50 (bench/RESULTS.md); not measured on an Intel part with two 512-bit FMA
// ports, where they may pay.

// NB output pixels x KB blocks of 16 output channels. w[b]: block b's packed filter.
template <int NB, int KB>
KERNEL void block512(const float* const* base, const float* const* w, const Taps& t, float* const* out) {
  __m512 acc[NB][KB];
  for (int i = 0; i < NB; ++i)
    for (int b = 0; b < KB; ++b) acc[i][b] = _mm512_setzero_ps();
  for (int64_t r = 0; r < t.R; ++r) {
    for (int64_t s = 0; s < t.S; ++s) {
      const int64_t off = r * t.row + s * t.C, tap0 = (r * t.S + s) * t.C * 16;
      for (int64_t c = 0; c < t.C; ++c) {
        __m512 wv[KB];
        for (int b = 0; b < KB; ++b) wv[b] = _mm512_loadu_ps(w[b] + tap0 + 16 * c);
        for (int i = 0; i < NB; ++i) {
          const __m512 x = _mm512_set1_ps(base[i][off + c]);
          for (int b = 0; b < KB; ++b) acc[i][b] = _mm512_fmadd_ps(x, wv[b], acc[i][b]);
        }
      }
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int b = 0; b < KB; ++b) _mm512_storeu_ps(out[i] + 16 * b, acc[i][b]);
}

// Weight gradient of NB taps x KB blocks of 16 output channels (dy: the first block's channels).
template <int NB, int KB>
KERNEL void filter_block512(const float* xpad, const int64_t* off, const float* dy, const Taps& t, int64_t stride, int64_t P,
                     int64_t Q, float* const* dw) {
  __m512 acc[NB][KB];
  for (int i = 0; i < NB; ++i)
    for (int b = 0; b < KB; ++b) acc[i][b] = _mm512_loadu_ps(dw[i] + 16 * b);
  for (int64_t p = 0; p < P; ++p) {
    const float* x = xpad + p * stride * t.row;
    const float* d = dy + p * Q * t.K;
    for (int64_t q = 0; q < Q; ++q, x += stride * t.C, d += t.K) {
      __m512 dv[KB];
      for (int b = 0; b < KB; ++b) dv[b] = _mm512_loadu_ps(d + 16 * b);
      for (int i = 0; i < NB; ++i) {
        const __m512 xv = _mm512_set1_ps(x[off[i]]);
        for (int b = 0; b < KB; ++b) acc[i][b] = _mm512_fmadd_ps(xv, dv[b], acc[i][b]);
      }
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int b = 0; b < KB; ++b) _mm512_storeu_ps(dw[i] + 16 * b, acc[i][b]);
}

// Every output channel of NB taps: 32 at a time, then 16, then the AVX2 kernel for a last 8.
template <int NB>
KERNEL void filter_taps512(const float* xpad, const int64_t* off, const float* dy, const Taps& t, int64_t stride,
                    int64_t P, int64_t Q, float* const* dw) {
  int64_t k = 0;
  float* o[NB];
  auto at = [&](int64_t k) {
    for (int i = 0; i < NB; ++i) o[i] = dw[i] + k;
  };
  for (; k + 32 <= t.K; k += 32) {
    at(k);
    filter_block512<NB, 2>(xpad, off, dy + k, t, stride, P, Q, o);
  }
  if (k + 16 <= t.K) {
    at(k);
    filter_block512<NB, 1>(xpad, off, dy + k, t, stride, P, Q, o);
    k += 16;
  }
  if (k < t.K) {  // 8 channels: as many AVX2 calls as it takes, 6 taps each
    for (int i0 = 0; i0 < NB; i0 += kPixels)
      with_nb<kPixels>(std::min(kPixels, NB - i0), [&](auto n) {
        float* o8[kPixels];
        for (int i = 0; i < n; ++i) o8[i] = dw[i0 + i] + k;
        filter_block<decltype(n)::value, 1>(xpad, off + i0, dy + k, t, stride, P, Q, o8);
      });
  }
}
#endif

// The two entry points' loops, once per path: Zmm false is the AVX2 kernels alone (what the avx2
// copy runs, and the avx512 copy by default), Zmm true the 512-bit ones. The avx2 copy used to
// instantiate the AVX2 weight-gradient kernel for the 512-bit tile counts too (7..12 taps: 24
// accumulators in 16 registers) inside one dispatch, and its weight gradient took 14-34% more perf
// samples than the pre-#32 AVX2 build's (bench/RESULTS.md, #32).
template <bool Zmm>
void backward_filter_body(const float* xpad, int64_t Wp, int64_t C, const float* dy, int64_t K, int64_t R,
                          int64_t S, int64_t stride, int64_t P, int64_t Q, float* dw) {
  const Taps t{C, K, R, S, Wp * C};
  const int64_t RSC = R * S * C;
  constexpr int kTaps = Zmm ? kPixels512 : kPixels;
  // Output rows a band at a time, every block of taps over one band before the next: the band's
  // dy rows and the input rows under them stay in L2 while all RSC / 6 tap blocks read them
  // (over a whole wide image they were re-read from L3 once per tap block); dw's accumulators
  // are loaded and stored once per band instead of once per image.
  const int64_t row_bytes = (Q * K + stride * Wp * C) * static_cast<int64_t>(sizeof(float));
  const int64_t band = std::clamp<int64_t>(kBandBytes / std::max<int64_t>(row_bytes, 1), 1, P);
  for (int64_t p0 = 0; p0 < P; p0 += band) {
    const int64_t rows = std::min(band, P - p0);
    const float* xb = xpad + p0 * stride * t.row;
    const float* db = dy + p0 * Q * K;
    for (int64_t j0 = 0; j0 < RSC; j0 += kTaps) {  // taps (r, s, c) in RSC order, across (r, s) ends
      const int nb = static_cast<int>(std::min<int64_t>(kTaps, RSC - j0));
      int64_t off[kTaps];
      float* out[kTaps];
      for (int i = 0; i < nb; ++i) {
        const int64_t j = j0 + i, c = j % C, s = (j / C) % S, r = j / (C * S);
        off[i] = r * t.row + s * C + c;
        out[i] = dw + j * K;
      }
#if defined(__AVX512F__)
      if constexpr (Zmm) {
        with_nb<kTaps>(nb, [&](auto n) { filter_taps512<decltype(n)::value>(xb, off, db, t, stride, rows, Q, out); });
        continue;
      }
#endif
      with_nb<kPixels>(nb, [&](auto n) { filter_taps<decltype(n)::value>(xb, off, db, t, stride, rows, Q, out); });
    }
  }
}

template <bool Zmm>
void forward_body(const float* xpad, int64_t Wp, int64_t C, const float* w, int64_t K, int64_t R, int64_t S,
                  int64_t stride, int64_t P, int64_t Q, float* y) {
  const Taps t{C, K, R, S, Wp * C};
  const int64_t PQ = P * Q, RSC = R * S * C;
  constexpr int kMaxTile = Zmm ? kPixels512 : kPixels;
  // One group of output channels at a time (AVX2: 16 or a last 8; AVX-512: 32, 16, or a last 8
  // through the AVX2 kernel), over every pixel in raster order, across row ends.
  for (int64_t k0 = 0; k0 < K;) {
    const int64_t left = K - k0;
    const int kb = !Zmm ? 0 : left >= 32 ? 2 : left >= 16 ? 1 : 0;  // 16-channel blocks in zmm; 0: 8 in ymm
    const int64_t width = kb ? 16 * kb : std::min<int64_t>(16, left);
    const int tile = kb ? kPixels512 : kPixels;
    const float* wk[2] = {w + k0 * RSC, kb == 2 ? w + (k0 + 16) * RSC : nullptr};
    for (int64_t j0 = 0; j0 < PQ; j0 += tile) {
      const int nb = static_cast<int>(std::min<int64_t>(tile, PQ - j0));
      const float* base[kMaxTile];
      float* out[kMaxTile];
      for (int i = 0; i < nb; ++i) {
        const int64_t p = (j0 + i) / Q, q = (j0 + i) % Q;
        base[i] = xpad + (p * stride * Wp + q * stride) * C;
        out[i] = y + (j0 + i) * K + k0;
      }
#if defined(__AVX512F__)
      if constexpr (Zmm) {
        if (kb == 2) {
          with_nb<kPixels512>(nb, [&](auto n) { block512<decltype(n)::value, 2>(base, wk, t, out); });
          continue;
        }
        if (kb == 1) {
          with_nb<kPixels512>(nb, [&](auto n) { block512<decltype(n)::value, 1>(base, wk, t, out); });
          continue;
        }
      }
#endif
      with_nb<kPixels>(nb, [&](auto n) {
        if (width == 16)
          block<decltype(n)::value, 2>(base, wk[0], t, out);
        else
          block<decltype(n)::value, 1>(base, wk[0], t, out);
      });
    }
    k0 += width;
  }
}

}  // namespace

void backward_filter_image(const float* xpad, int64_t Wp, int64_t C, const float* dy, int64_t K, int64_t R,
                           int64_t S, int64_t stride, int64_t P, int64_t Q, float* dw) {
#if defined(__AVX512F__)
  if (direct::zmm_enabled()) return backward_filter_body<true>(xpad, Wp, C, dy, K, R, S, stride, P, Q, dw);
#endif
  backward_filter_body<false>(xpad, Wp, C, dy, K, R, S, stride, P, Q, dw);
}

void forward_image(const float* xpad, int64_t Wp, int64_t C, const float* w, int64_t K, int64_t R, int64_t S,
                   int64_t stride, int64_t P, int64_t Q, float* y) {
#if defined(__AVX512F__)
  if (direct::zmm_enabled()) return forward_body<true>(xpad, Wp, C, w, K, R, S, stride, P, Q, y);
#endif
  forward_body<false>(xpad, Wp, C, w, K, R, S, stride, P, Q, y);
}
#else
void forward_image(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                   int64_t, float*) {
  throw Error("direct convolution: the baseline kernel copy has no direct kernels");  // conv.cpp never calls them here
}
void backward_filter_image(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, float*) {
  throw Error("direct convolution: the baseline kernel copy has no direct kernels");
}
#endif

#undef KERNEL

}  // namespace replica::ops::REPLICA_CPU_ISA_NS::direct_kernels
