// Direct NHWC convolution kernels (see direct_conv.h). The AVX2 code is compiled with a target
// attribute and entered only after a run-time CPU check, so a portable build (-march=x86-64)
// carries it too and still runs on a CPU without AVX2 (the im2col path serves it).
#include "ops/cpu/direct_conv.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "core/cpu_features.h"
#include "core/env.h"
#include "core/errors.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define REPLICA_DIRECT_AVX2 1
#endif

namespace replica::ops::direct {

namespace {
// AVX2 + FMA present and allowed (REPLICA_CPU_ISA=baseline turns the kernel off too).
bool cpu_has_avx2_fma() {
#ifdef REPLICA_DIRECT_AVX2
  return cpu_isa_enabled(CpuIsa::avx2);
#else
  return false;
#endif
}
std::atomic<bool>& enabled() {
  static std::atomic<bool> on{env_flag("REPLICA_DIRECT_CONV", true)};
  return on;
}
}  // namespace

bool available() { return cpu_has_avx2_fma() && enabled().load(std::memory_order_relaxed); }

bool set_enabled(bool on) { return enabled().exchange(on) && cpu_has_avx2_fma(); }

bool serves_forward(const ConvGeom& g) { return available() && g.K % 8 == 0; }

bool serves_backward_data(const ConvGeom& g) {
  return available() && g.stride == 1 && g.R == g.S && g.pad < g.R && g.C % 8 == 0;
}

// Measured per ResNet-20 and ResNet-50 layer (bench/RESULTS.md): the direct weight gradient wins
// on every layer with at most 64 input and output channels (up to 3x the GEMM on ResNet-20's)
// and, since it works a band of output rows at a time, on the wide layers with at least 28 x 28
// output pixels too (1.0-1.6x); on wide layers with small outputs (14 x 14, 7 x 7) it loses up to
// 1.6x (each image's accumulators are loaded and stored for few pixels), so those keep im2col.
bool serves_backward_filter(const ConvGeom& g) {
  return available() && g.K % 8 == 0 && ((g.K <= 64 && g.C <= 64) || g.P * g.Q >= 28 * 28);
}

namespace {
// Filter (i = tap (r, s, c), k) in the kernels' layout: blocks of 16 output channels (the last 8
// when K = 16 m + 8), each block's taps x channels contiguous, so one block's filter streams
// from one place while it is reused for every pixel of an image.
template <typename At>
void pack_blocks(int64_t taps, int64_t K, float* out, At at) {
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    const int64_t kw = std::min<int64_t>(16, K - k0);
    float* blk = out + k0 * taps;
    for (int64_t i = 0; i < taps; ++i)
      for (int64_t k = 0; k < kw; ++k) blk[i * kw + k] = at(i, k0 + k);
  }
}
}  // namespace

void pack_forward(const float* w, float* out, const ConvGeom& g) {
  const int64_t RSC = g.R * g.S * g.C;
  pack_blocks(RSC, g.K, out, [&](int64_t i, int64_t k) { return w[k * RSC + i]; });
}

void pack_backward_data(const float* w, float* out, const ConvGeom& g) {
  // Tap (r', s', k) of the flipped filter, output channel c: w[k][R-1-r'][S-1-s'][c].
  pack_blocks(g.R * g.S * g.K, g.C, out, [&](int64_t i, int64_t c) {
    const int64_t k = i % g.K, s = (i / g.K) % g.S, r = i / (g.K * g.S);
    return w[((k * g.R + (g.R - 1 - r)) * g.S + (g.S - 1 - s)) * g.C + c];
  });
}

#ifdef REPLICA_DIRECT_AVX2
// The AVX2 code lives in a namespace that says so: the test that checks a portable build for
// instructions above its baseline (tests/install/check_baseline_isa.sh) allows them only in
// functions whose names carry the level.
namespace {
namespace avx2 {

struct Taps {
  int64_t C, K, R, S, row;  // row: floats from one padded input row to the next
};

// NB output pixels x KV vectors of 8 output channels, summed over R x S x C. base[i]: pixel i's
// top-left tap in the padded input; w: the filter's first output channel of this block.
template <int NB, int KV>
__attribute__((target("avx2,fma"))) void block(const float* const* base, const float* w, const Taps& t,
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
__attribute__((target("avx2,fma"))) void filter_block(const float* xpad, const int64_t* off, const float* dy,
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
void filter_taps(const float* xpad, const int64_t* off, const float* dy, const Taps& t, int64_t stride, int64_t P,
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

}  // namespace avx2
}  // namespace
using namespace avx2;

void backward_filter_image(const float* xpad, int64_t Wp, int64_t C, const float* dy, int64_t K, int64_t R,
                           int64_t S, int64_t stride, int64_t P, int64_t Q, float* dw) {
  const Taps t{C, K, R, S, Wp * C};
  const int64_t RSC = R * S * C;
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
    for (int64_t j0 = 0; j0 < RSC; j0 += kPixels) {  // taps (r, s, c) in RSC order, across (r, s) ends
      const int nb = static_cast<int>(std::min<int64_t>(kPixels, RSC - j0));
      int64_t off[kPixels];
      float* out[kPixels];
      for (int i = 0; i < nb; ++i) {
        const int64_t j = j0 + i, c = j % C, s = (j / C) % S, r = j / (C * S);
        off[i] = r * t.row + s * C + c;
        out[i] = dw + j * K;
      }
      switch (nb) {
        case 6: filter_taps<6>(xb, off, db, t, stride, rows, Q, out); break;
        case 5: filter_taps<5>(xb, off, db, t, stride, rows, Q, out); break;
        case 4: filter_taps<4>(xb, off, db, t, stride, rows, Q, out); break;
        case 3: filter_taps<3>(xb, off, db, t, stride, rows, Q, out); break;
        case 2: filter_taps<2>(xb, off, db, t, stride, rows, Q, out); break;
        default: filter_taps<1>(xb, off, db, t, stride, rows, Q, out); break;
      }
    }
  }
}

void forward_image(const float* xpad, int64_t Wp, int64_t C, const float* w, int64_t K, int64_t R, int64_t S,
                   int64_t stride, int64_t P, int64_t Q, float* y) {
  const Taps t{C, K, R, S, Wp * C};
  const int64_t PQ = P * Q, RSC = R * S * C;
  for (int64_t k0 = 0; k0 < K; k0 += 16) {  // one filter block at a time, over every pixel
    const bool wide = K - k0 >= 16;
    const float* wk = w + k0 * RSC;
    for (int64_t j0 = 0; j0 < PQ; j0 += kPixels) {  // pixels in raster order, across row ends
      const int nb = static_cast<int>(std::min<int64_t>(kPixels, PQ - j0));
      const float* base[kPixels];
      float* out[kPixels];
      for (int i = 0; i < nb; ++i) {
        const int64_t p = (j0 + i) / Q, q = (j0 + i) % Q;
        base[i] = xpad + (p * stride * Wp + q * stride) * C;
        out[i] = y + (j0 + i) * K + k0;
      }
#define REPLICA_PIXELS(NB) (wide ? block<NB, 2>(base, wk, t, out) : block<NB, 1>(base, wk, t, out))
      switch (nb) {
        case 6: REPLICA_PIXELS(6); break;
        case 5: REPLICA_PIXELS(5); break;
        case 4: REPLICA_PIXELS(4); break;
        case 3: REPLICA_PIXELS(3); break;
        case 2: REPLICA_PIXELS(2); break;
        default: REPLICA_PIXELS(1); break;
      }
#undef REPLICA_PIXELS
    }
  }
}
#else
void forward_image(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                   int64_t, float*) {
  throw Error("direct convolution: not compiled for this CPU");  // available() is false here
}
void backward_filter_image(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, float*) {
  throw Error("direct convolution: not compiled for this CPU");
}
#endif

}  // namespace replica::ops::direct
