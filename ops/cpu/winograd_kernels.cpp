// Winograd F(2x2, 3x3) kernels of one CPU kernel copy (see winograd_kernels.h), compiled once per
// level with the copy's -march (ops/CMakeLists.txt). The tiles of a chunk of images are taken a
// block at a time: the block's input transforms (16 x tiles x C), then 16 small GEMMs against the
// transformed filter, then the output transforms, so the block's transformed data stays in L2.
//
// With x a 4x4 input tile (zero outside the image), g a 3x3 filter and y the 2x2 output tile:
//   y = A^T [ (G g G^T) . (B^T x B) ] A,   B^T = | 1  0 -1  0 |   G = | 1    0    0  |   A^T = | 1 1  1  0 |
//                                                | 0  1  1  0 |       | 1/2  1/2  1/2|         | 0 1 -1 -1 |
//                                                | 0 -1  1  0 |       | 1/2 -1/2  1/2|
//                                                | 0  1  0 -1 |       | 0    0    1  |
// and the weight gradient dg = G^T [ sum over tiles (B^T x B) . (A dy A^T) ] G.
#include "ops/cpu/winograd_kernels.h"

#include <algorithm>
#include <type_traits>

#include "core/errors.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace replica::ops::REPLICA_CPU_ISA_NS::winograd {

namespace {
// Tiles per block: the block's transformed input and products (16 x tiles x (C + K) floats) in
// about 128 KiB, a multiple of the GEMM's 6 rows; above 64 x 64 channels at least 24 tiles: the
// transformed filter (16 C K floats) is then read from L3 once per block, so a block must be
// tall enough to pay for it.
int64_t tile_block(int64_t C, int64_t K) {
  const int64_t tiles = (int64_t(128) << 10) / (16 * (C + K) * int64_t(sizeof(float)));
  return std::max<int64_t>(C * K > 64 * 64 ? 24 : 6, tiles / 6 * 6);
}
}  // namespace

// The block's transformed input and products, then C zeros (what input_tile reads outside an image).
namespace {
// G g G^T for n channel pairs at once: g[r * 3 + s][e] (tap (r, s) of pair e) into u[p][e] (p =
// 4 i + j). Rows of G: (1, 0, 0), (1/2, 1/2, 1/2), (1/2, -1/2, 1/2), (0, 0, 1); halving is exact,
// so the order of these sums is the only rounding.
void transform_pairs(const float* const* g, float* const* u, int64_t n) {
  // 16 pairs at a time through local arrays: with 25 pointers that may alias, GCC vectorised
  // nothing when the loops read and wrote through them directly.
  constexpr int kE = 16;
  for (int64_t e0 = 0; e0 < n; e0 += kE) {
    const int m = static_cast<int>(std::min<int64_t>(kE, n - e0));
    float gl[9][kE] = {}, ul[16][kE];
    for (int t = 0; t < 9; ++t)
      for (int e = 0; e < m; ++e) gl[t][e] = g[t][e0 + e];
    for (int e = 0; e < kE; ++e) {
      float t[4][3];  // G g: rows i, columns s
      for (int s = 0; s < 3; ++s) {
        const float g0 = gl[s][e], g1 = gl[3 + s][e], g2 = gl[6 + s][e];
        t[0][s] = g0;
        t[1][s] = 0.5f * (g0 + g1 + g2);
        t[2][s] = 0.5f * (g0 - g1 + g2);
        t[3][s] = g2;
      }
      for (int i = 0; i < 4; ++i) {
        ul[i * 4 + 0][e] = t[i][0];
        ul[i * 4 + 1][e] = 0.5f * (t[i][0] + t[i][1] + t[i][2]);
        ul[i * 4 + 2][e] = 0.5f * (t[i][0] - t[i][1] + t[i][2]);
        ul[i * 4 + 3][e] = t[i][2];
      }
    }
    for (int p = 0; p < 16; ++p)
      for (int e = 0; e < m; ++e) u[p][e0 + e] = ul[p][e];
  }
}
}  // namespace

void filter_forward(const float* w, float* u, int64_t C, int64_t K, float* wt) {
  // w[k][r][s][c] transposed to [r][s][c][k] first, so each input channel's K pairs are contiguous.
  for (int64_t k = 0; k < K; ++k)
    for (int64_t t = 0; t < 9; ++t)
      for (int64_t c = 0; c < C; ++c) wt[(t * C + c) * K + k] = w[(k * 9 + t) * C + c];
  for (int64_t c = 0; c < C; ++c) {
    const float* g[9];
    float* out[16];
    for (int t = 0; t < 9; ++t) g[t] = wt + (t * C + c) * K;
    for (int p = 0; p < 16; ++p) out[p] = u + (p * C + c) * K;
    transform_pairs(g, out, K);
  }
}

void filter_backward_data(const float* w, float* u, int64_t C, int64_t K, float*) {
  // Input channel k of dy, output channel c of dx: the flipped filter, tap (r, s) = w[k][2-r][2-s][c];
  // for each k its C pairs are contiguous already.
  for (int64_t k = 0; k < K; ++k) {
    const float* g[9];
    float* out[16];
    for (int t = 0; t < 9; ++t) g[t] = w + (k * 9 + (8 - t)) * C;
    for (int p = 0; p < 16; ++p) out[p] = u + (p * K + k) * C;
    transform_pairs(g, out, C);
  }
}

void filter_gradient(const float* du, float* dw, int64_t C, int64_t K, float* dt) {
  // G^T du G for each input channel's K pairs (contiguous in du), into [r][s][c][k], then added
  // to dw[k][r][s][c].
  for (int64_t c = 0; c < C; ++c) {
    const float* d[16];
    for (int p = 0; p < 16; ++p) d[p] = du + (p * C + c) * K;
    float* out[9];
    for (int t = 0; t < 9; ++t) out[t] = dt + (t * C + c) * K;
    for (int64_t k = 0; k < K; ++k) {
      float t[3][4];  // G^T du: rows r, columns j
      for (int j = 0; j < 4; ++j) {
        const float d0 = d[j][k], d1 = d[4 + j][k], d2 = d[8 + j][k], d3 = d[12 + j][k];
        t[0][j] = d0 + 0.5f * (d1 + d2);
        t[1][j] = 0.5f * (d1 - d2);
        t[2][j] = 0.5f * (d1 + d2) + d3;
      }
      for (int r = 0; r < 3; ++r) {
        out[r * 3 + 0][k] = t[r][0] + 0.5f * (t[r][1] + t[r][2]);
        out[r * 3 + 1][k] = 0.5f * (t[r][1] - t[r][2]);
        out[r * 3 + 2][k] = 0.5f * (t[r][1] + t[r][2]) + t[r][3];
      }
    }
  }
  for (int64_t k = 0; k < K; ++k)
    for (int64_t t = 0; t < 9; ++t)
      for (int64_t c = 0; c < C; ++c) dw[(k * 9 + t) * C + c] += dt[(t * C + c) * K + k];
}

int64_t scratch_floats(int64_t C, int64_t K) { return 16 * tile_block(C, K) * (C + K) + C; }

#if defined(__AVX2__) && defined(__FMA__)
namespace {

// Forced inline for the reason direct_kernels.cpp gives: out of line, GCC 12 spills the
// accumulators on every step.
#define KERNEL inline __attribute__((always_inline))

// Where one tile sits: image n, tile row ti, tile column tj (its output rows 2 ti, 2 ti + 1).
struct Tile {
  int64_t n, ti, tj;
};
struct TileGrid {
  int64_t H, W, TH, TW;
  explicit TileGrid(int64_t H, int64_t W) : H(H), W(W), TH((H + 1) / 2), TW((W + 1) / 2) {}
  Tile at(int64_t t) const {
    const int64_t per_image = TH * TW, r = t % per_image;
    return {t / per_image, r / TW, r % TW};
  }
  // The tile after tl in raster order across images (no division: at 16 channels a tile's work
  // is a few hundred cycles, and two divisions per tile showed).
  void next(Tile& tl) const {
    if (++tl.tj < TW) return;
    tl.tj = 0;
    if (++tl.ti < TH) return;
    tl.ti = 0;
    ++tl.n;
  }
};

// B^T d B of one 4x4 tile of 8 channels, written to v[p * vs] for the 16 positions p.
KERNEL void input_transform(const __m256 (&d)[4][4], float* v, int64_t vs) {
  __m256 t[4][4];
  for (int j = 0; j < 4; ++j) {
    t[0][j] = _mm256_sub_ps(d[0][j], d[2][j]);
    t[1][j] = _mm256_add_ps(d[1][j], d[2][j]);
    t[2][j] = _mm256_sub_ps(d[2][j], d[1][j]);
    t[3][j] = _mm256_sub_ps(d[1][j], d[3][j]);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(v + (i * 4 + 0) * vs, _mm256_sub_ps(t[i][0], t[i][2]));
    _mm256_storeu_ps(v + (i * 4 + 1) * vs, _mm256_add_ps(t[i][1], t[i][2]));
    _mm256_storeu_ps(v + (i * 4 + 2) * vs, _mm256_sub_ps(t[i][2], t[i][1]));
    _mm256_storeu_ps(v + (i * 4 + 3) * vs, _mm256_sub_ps(t[i][1], t[i][3]));
  }
}

// The input tile whose outputs start at (2 ti, 2 tj): rows 2 ti - 1 .. 2 ti + 2 of the image,
// zero outside it; every 8 channels transformed into v (position stride vs). Pixels outside the
// image read `zeros` (C floats), so the channel loop has no branch (on 7 x 7 and 14 x 14 images
// most tiles touch the border).
KERNEL void input_tile(const float* img, const TileGrid& g, int64_t C, const Tile& tl, const float* zeros, float* v,
                       int64_t vs) {
  const int64_t h0 = 2 * tl.ti - 1, w0 = 2 * tl.tj - 1;
  const float* src[4][4];
  if (h0 >= 0 && w0 >= 0 && h0 + 3 < g.H && w0 + 3 < g.W) {  // most tiles of a large image
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) src[i][j] = img + ((h0 + i) * g.W + w0 + j) * C;
  } else {
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) {
        const int64_t h = h0 + i, w = w0 + j;
        src[i][j] = h >= 0 && h < g.H && w >= 0 && w < g.W ? img + (h * g.W + w) * C : zeros;
      }
  }
  for (int64_t c0 = 0; c0 < C; c0 += 8) {
    __m256 d[4][4];
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) d[i][j] = _mm256_loadu_ps(src[i][j] + c0);
    input_transform(d, v + c0, vs);
  }
}

// A^T m A of one tile's 16 products (m[p * ms], every 8 channels), stored where the tile's 2x2
// outputs lie inside the image.
KERNEL void output_tile(const float* m, int64_t ms, int64_t K, float* img, const TileGrid& g, const Tile& tl) {
  const int64_t h0 = 2 * tl.ti, w0 = 2 * tl.tj;
  const bool h1 = h0 + 1 < g.H, w1 = w0 + 1 < g.W;
  for (int64_t k0 = 0; k0 < K; k0 += 8) {
    __m256 t0[4], t1[4];
    for (int j = 0; j < 4; ++j) {
      const __m256 m0 = _mm256_loadu_ps(m + (0 * 4 + j) * ms + k0), m1 = _mm256_loadu_ps(m + (1 * 4 + j) * ms + k0);
      const __m256 m2 = _mm256_loadu_ps(m + (2 * 4 + j) * ms + k0), m3 = _mm256_loadu_ps(m + (3 * 4 + j) * ms + k0);
      t0[j] = _mm256_add_ps(_mm256_add_ps(m0, m1), m2);
      t1[j] = _mm256_sub_ps(_mm256_sub_ps(m1, m2), m3);
    }
    float* o = img + (h0 * g.W + w0) * K + k0;
    _mm256_storeu_ps(o, _mm256_add_ps(_mm256_add_ps(t0[0], t0[1]), t0[2]));
    if (w1) _mm256_storeu_ps(o + K, _mm256_sub_ps(_mm256_sub_ps(t0[1], t0[2]), t0[3]));
    if (h1) {
      o += g.W * K;
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_add_ps(t1[0], t1[1]), t1[2]));
      if (w1) _mm256_storeu_ps(o + K, _mm256_sub_ps(_mm256_sub_ps(t1[1], t1[2]), t1[3]));
    }
  }
}

// A dy A^T of one tile's 2x2 output gradient (zero outside the image), every 8 channels, into
// d[p * ds].
KERNEL void grad_tile(const float* dimg, const TileGrid& g, int64_t K, const Tile& tl, float* d, int64_t ds) {
  const int64_t h0 = 2 * tl.ti, w0 = 2 * tl.tj;
  const bool h1 = h0 + 1 < g.H, w1 = w0 + 1 < g.W;
  for (int64_t k0 = 0; k0 < K; k0 += 8) {
    const float* src = dimg + (h0 * g.W + w0) * K + k0;
    const __m256 z = _mm256_setzero_ps();
    const __m256 y00 = _mm256_loadu_ps(src), y01 = w1 ? _mm256_loadu_ps(src + K) : z;
    const __m256 y10 = h1 ? _mm256_loadu_ps(src + g.W * K) : z, y11 = h1 && w1 ? _mm256_loadu_ps(src + g.W * K + K) : z;
    // Rows (A dy): y0, y0 + y1, y0 - y1, -y1, for each of the two columns.
    const __m256 r[4][2] = {{y00, y01},
                            {_mm256_add_ps(y00, y10), _mm256_add_ps(y01, y11)},
                            {_mm256_sub_ps(y00, y10), _mm256_sub_ps(y01, y11)},
                            {_mm256_sub_ps(z, y10), _mm256_sub_ps(z, y11)}};
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_ps(d + (i * 4 + 0) * ds + k0, r[i][0]);
      _mm256_storeu_ps(d + (i * 4 + 1) * ds + k0, _mm256_add_ps(r[i][0], r[i][1]));
      _mm256_storeu_ps(d + (i * 4 + 2) * ds + k0, _mm256_sub_ps(r[i][0], r[i][1]));
      _mm256_storeu_ps(d + (i * 4 + 3) * ds + k0, _mm256_sub_ps(z, r[i][1]));
    }
  }
}

// c (NB rows x 8 KV columns, row stride ldc) = a (NB x kred, row stride lda) times b (kred x 8 KV,
// row stride ldb): the direct kernel's register block, with a tile's transformed channels for
// the pixel's taps.
template <int NB, int KV>
KERNEL void gemm_block(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t kred, float* c, int64_t ldc) {
  __m256 acc[NB][KV];
  for (int i = 0; i < NB; ++i)
    for (int v = 0; v < KV; ++v) acc[i][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kred; ++k) {
    __m256 bv[KV];
    for (int v = 0; v < KV; ++v) bv[v] = _mm256_loadu_ps(b + k * ldb + 8 * v);
    for (int i = 0; i < NB; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + i * lda + k);
      for (int v = 0; v < KV; ++v) acc[i][v] = _mm256_fmadd_ps(x, bv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int v = 0; v < KV; ++v) _mm256_storeu_ps(c + i * ldc + 8 * v, acc[i][v]);
}

// c (NB rows x 8 KV columns) += a^T b over `rows`: a is rows x NB (row stride lda), b rows x 8 KV
// (row stride ldb). The weight gradient's reduction over tiles, kept in registers.
template <int NB, int KV>
KERNEL void gemm_tn_block(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t rows, float* c,
                          int64_t ldc) {
  __m256 acc[NB][KV];
  for (int i = 0; i < NB; ++i)
    for (int v = 0; v < KV; ++v) acc[i][v] = _mm256_loadu_ps(c + i * ldc + 8 * v);
  for (int64_t t = 0; t < rows; ++t) {
    __m256 bv[KV];
    for (int v = 0; v < KV; ++v) bv[v] = _mm256_loadu_ps(b + t * ldb + 8 * v);
    for (int i = 0; i < NB; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + t * lda + i);
      for (int v = 0; v < KV; ++v) acc[i][v] = _mm256_fmadd_ps(x, bv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int v = 0; v < KV; ++v) _mm256_storeu_ps(c + i * ldc + 8 * v, acc[i][v]);
}

constexpr int kRows = 6;  // 6 x 2 accumulators + 2 loaded vectors + 1 broadcast: 15 of 16 ymm

// Calls f(std::integral_constant<int, NB>{}) for a run-time nb in 1..Max (the blocks' tails).
template <int Max, typename F>
KERNEL void with_nb(int nb, F&& f) {
  if constexpr (Max > 1) {
    if (nb < Max) return with_nb<Max - 1>(nb, f);
  }
  f(std::integral_constant<int, Max>{});
}

// c (rows x n) = a (rows x kred) b (kred x n), all row-major and dense; n a multiple of 8.
void gemm(const float* a, int64_t rows, int64_t kred, const float* b, int64_t n, float* c) {
  for (int64_t k0 = 0; k0 < n; k0 += 16) {
    const bool two = k0 + 16 <= n;
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int nb = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
      with_nb<kRows>(nb, [&](auto m) {
        if (two)
          gemm_block<decltype(m)::value, 2>(a + r0 * kred, kred, b + k0, n, kred, c + r0 * n + k0, n);
        else
          gemm_block<decltype(m)::value, 1>(a + r0 * kred, kred, b + k0, n, kred, c + r0 * n + k0, n);
      });
    }
  }
}

// c (m x n) += a^T b: a is rows x m, b rows x n (row-major, dense); n a multiple of 8.
void gemm_tn(const float* a, int64_t rows, int64_t m, const float* b, int64_t n, float* c) {
  for (int64_t k0 = 0; k0 < n; k0 += 16) {
    const bool two = k0 + 16 <= n;
    for (int64_t i0 = 0; i0 < m; i0 += kRows) {
      const int nb = static_cast<int>(std::min<int64_t>(kRows, m - i0));
      with_nb<kRows>(nb, [&](auto mm) {
        if (two)
          gemm_tn_block<decltype(mm)::value, 2>(a + i0, m, b + k0, n, rows, c + i0 * n + k0, n);
        else
          gemm_tn_block<decltype(mm)::value, 1>(a + i0, m, b + k0, n, rows, c + i0 * n + k0, n);
      });
    }
  }
}

}  // namespace

void forward(const float* x, int64_t N, int64_t H, int64_t W, int64_t C, const float* u, int64_t K, float* y,
             float* scratch) {
  const TileGrid g(H, W);
  const int64_t TB = tile_block(C, K), T = N * g.TH * g.TW;
  float* v = scratch;            // 16 x TB x C
  float* m = scratch + 16 * TB * C;  // 16 x TB x K
  float* zeros = m + 16 * TB * K;
  std::fill(zeros, zeros + C, 0.f);
  for (int64_t t0 = 0; t0 < T; t0 += TB) {
    const int64_t tb = std::min(TB, T - t0);
    const Tile first = g.at(t0);
    Tile tl = first;
    for (int64_t i = 0; i < tb; ++i, g.next(tl)) input_tile(x + tl.n * H * W * C, g, C, tl, zeros, v + i * C, TB * C);
    for (int p = 0; p < 16; ++p) gemm(v + p * TB * C, tb, C, u + p * C * K, K, m + p * TB * K);
    tl = first;
    for (int64_t i = 0; i < tb; ++i, g.next(tl)) output_tile(m + i * K, TB * K, K, y + tl.n * H * W * K, g, tl);
  }
}

void backward_filter(const float* x, const float* dy, int64_t N, int64_t H, int64_t W, int64_t C, int64_t K,
                     float* du, float* scratch) {
  const TileGrid g(H, W);
  const int64_t TB = tile_block(C, K), T = N * g.TH * g.TW;
  float* v = scratch;                // 16 x TB x C
  float* d = scratch + 16 * TB * C;  // 16 x TB x K
  float* zeros = d + 16 * TB * K;
  std::fill(zeros, zeros + C, 0.f);
  for (int64_t t0 = 0; t0 < T; t0 += TB) {
    const int64_t tb = std::min(TB, T - t0);
    Tile tl = g.at(t0);
    for (int64_t i = 0; i < tb; ++i, g.next(tl)) {
      input_tile(x + tl.n * H * W * C, g, C, tl, zeros, v + i * C, TB * C);
      grad_tile(dy + tl.n * H * W * K, g, K, tl, d + i * K, TB * K);
    }
    for (int p = 0; p < 16; ++p) gemm_tn(v + p * TB * C, tb, C, d + p * TB * K, K, du + p * C * K);
  }
}

#undef KERNEL
#else
void forward(const float*, int64_t, int64_t, int64_t, int64_t, const float*, int64_t, float*, float*) {
  throw Error("Winograd convolution: the baseline kernel copy has no Winograd kernels");  // conv.cpp never calls them here
}
void backward_filter(const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t, float*, float*) {
  throw Error("Winograd convolution: the baseline kernel copy has no Winograd kernels");
}
#endif

}  // namespace replica::ops::REPLICA_CPU_ISA_NS::winograd
