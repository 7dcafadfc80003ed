// Winograd F(2x2, 3x3) and F(4x4, 3x3) kernels of one CPU kernel copy (see winograd_kernels.h),
// compiled once per level with the copy's -march (ops/CMakeLists.txt). The tiles of a chunk of
// images are taken a block at a time: the block's input transforms (T^2 x tiles x C, T = m + 2),
// then T^2 small GEMMs against the transformed filter, then the output transforms, so the block's
// transformed data stays in L2.
//
// With x a T x T input tile (zero outside the image), g a 3x3 filter and y the m x m output tile:
//   y = A^T [ (G g G^T) . (B^T x B) ] A   and the weight gradient dg = G^T [ sum over tiles
//   (B^T x B) . (A dy A^T) ] G. Every 2-D transform is its 1-D transform (below, `Tile1d`) down
// the columns, then along the rows.
//   F(2x2, 3x3), points 0, 1, -1:
//     B^T = | 1  0 -1  0 |   G = | 1    0    0  |   A^T = | 1 1  1  0 |
//           | 0  1  1  0 |       | 1/2  1/2  1/2|         | 0 1 -1 -1 |
//           | 0 -1  1  0 |       | 1/2 -1/2  1/2|
//           | 0  1  0 -1 |       | 0    0    1  |
//   F(4x4, 3x3), points 0, 1, -1, 2, -2 (Lavin and Gray, 2016):
//     B^T = | 4  0 -5  0  1  0 |   G = |  1/4     0     0  |   A^T = | 1  1  1  1  1  0 |
//           | 0 -4 -4  1  1  0 |       | -1/6  -1/6  -1/6  |         | 0  1 -1  2 -2  0 |
//           | 0  4 -4 -1  1  0 |       | -1/6   1/6  -1/6  |         | 0  1  1  4  4  0 |
//           | 0 -2 -1  2  1  0 |       |  1/24  1/12  1/6  |         | 0  1 -1  8 -8  1 |
//           | 0  2 -1 -2  1  0 |       |  1/24 -1/12  1/6  |
//           | 0  4  0 -5  0  1 |       |  0     0     1    |
//   (checked in exact arithmetic against the direct sums before they were written here). F(4x4)
//   does 36 products per 16 outputs (2.25 per output, against F(2x2)'s 4 and the direct
//   kernel's 9), for larger transform constants: its error is about ten times F(2x2)'s
//   (tests/ops/test_conv_kernels.cpp measures both).
#include "ops/cpu/winograd_kernels.h"

#include <algorithm>
#include <string>
#include <type_traits>

#include "core/errors.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace replica::ops::REPLICA_CPU_ISA_NS::winograd {

namespace {
// Tiles per block: the block's transformed input and products (T^2 x tiles x (C + K) floats) in
// about 128 KiB, a multiple of the GEMM's 6 rows; above 64 x 64 channels at least 24 tiles: the
// transformed filter (T^2 C K floats) is then read from L3 once per block, so a block must be
// tall enough to pay for it.
int64_t tile_block(int64_t C, int64_t K, int m) {
  const int64_t P = (m + 2) * (m + 2);
  const int64_t tiles = (int64_t(128) << 10) / (P * (C + K) * int64_t(sizeof(float)));
  return std::max<int64_t>(C * K > 64 * 64 ? 24 : 6, tiles / 6 * 6);
}

void check_tile(int m) {
  if (m != 2 && m != 4) throw Error("Winograd convolution: output tile " + std::to_string(m) + " (2 or 4)");
}

// The filter side's 1-D transforms, in float (portable: the filter transforms run in every copy).
template <int M>
struct Filter1d;
template <>
struct Filter1d<2> {
  // G g: 3 taps into 4; halving is exact, so the order of these sums is the only rounding.
  static void g(float g0, float g1, float g2, float* u) {
    u[0] = g0;
    u[1] = 0.5f * (g0 + g1 + g2);
    u[2] = 0.5f * (g0 - g1 + g2);
    u[3] = g2;
  }
  // G^T d: 4 into 3.
  static void gt(const float* d, float* r) {
    r[0] = d[0] + 0.5f * (d[1] + d[2]);
    r[1] = 0.5f * (d[1] - d[2]);
    r[2] = 0.5f * (d[1] + d[2]) + d[3];
  }
};
template <>
struct Filter1d<4> {
  // Divided by 6 and 24, not multiplied by rounded reciprocals: one rounding fewer.
  static void g(float g0, float g1, float g2, float* u) {
    u[0] = 0.25f * g0;
    u[1] = -(g0 + g1 + g2) / 6.f;
    u[2] = -(g0 - g1 + g2) / 6.f;
    u[3] = (0.25f * g0 + 0.5f * g1 + g2) / 6.f;
    u[4] = (0.25f * g0 - 0.5f * g1 + g2) / 6.f;
    u[5] = g2;
  }
  static void gt(const float* d, float* r) {
    r[0] = 0.25f * d[0] - (d[1] + d[2]) / 6.f + (d[3] + d[4]) / 24.f;
    r[1] = (d[2] - d[1]) / 6.f + (d[3] - d[4]) / 12.f;
    r[2] = (d[3] + d[4] - d[1] - d[2]) / 6.f + d[5];
  }
};

// G g G^T for n channel pairs at once: g[r * 3 + s][e] (tap (r, s) of pair e) into u[p][e] (p =
// T i + j).
template <int M>
void transform_pairs(const float* const* g, float* const* u, int64_t n) {
  constexpr int T = M + 2;
  // 16 pairs at a time through local arrays: with 9 + T^2 pointers that may alias, GCC vectorised
  // nothing when the loops read and wrote through them directly.
  constexpr int kE = 16;
  for (int64_t e0 = 0; e0 < n; e0 += kE) {
    const int m = static_cast<int>(std::min<int64_t>(kE, n - e0));
    float gl[9][kE] = {}, ul[T * T][kE];
    for (int t = 0; t < 9; ++t)
      for (int e = 0; e < m; ++e) gl[t][e] = g[t][e0 + e];
    for (int e = 0; e < kE; ++e) {
      float t[3][T];  // G g: column s of the taps in row s
      for (int s = 0; s < 3; ++s) Filter1d<M>::g(gl[s][e], gl[3 + s][e], gl[6 + s][e], t[s]);
      for (int i = 0; i < T; ++i) {
        float row[T];
        Filter1d<M>::g(t[0][i], t[1][i], t[2][i], row);
        for (int j = 0; j < T; ++j) ul[i * T + j][e] = row[j];
      }
    }
    for (int p = 0; p < T * T; ++p)
      for (int e = 0; e < m; ++e) u[p][e0 + e] = ul[p][e];
  }
}

template <int M>
void filter_forward_t(const float* w, float* u, int64_t C, int64_t K, float* wt) {
  constexpr int P = (M + 2) * (M + 2);
  // w[k][r][s][c] transposed to [r][s][c][k] first, so each input channel's K pairs are contiguous.
  for (int64_t k = 0; k < K; ++k)
    for (int64_t t = 0; t < 9; ++t)
      for (int64_t c = 0; c < C; ++c) wt[(t * C + c) * K + k] = w[(k * 9 + t) * C + c];
  for (int64_t c = 0; c < C; ++c) {
    const float* g[9];
    float* out[P];
    for (int t = 0; t < 9; ++t) g[t] = wt + (t * C + c) * K;
    for (int p = 0; p < P; ++p) out[p] = u + (p * C + c) * K;
    transform_pairs<M>(g, out, K);
  }
}

template <int M>
void filter_backward_data_t(const float* w, float* u, int64_t C, int64_t K) {
  constexpr int P = (M + 2) * (M + 2);
  // Input channel k of dy, output channel c of dx: the flipped filter, tap (r, s) = w[k][2-r][2-s][c];
  // for each k its C pairs are contiguous already.
  for (int64_t k = 0; k < K; ++k) {
    const float* g[9];
    float* out[P];
    for (int t = 0; t < 9; ++t) g[t] = w + (k * 9 + (8 - t)) * C;
    for (int p = 0; p < P; ++p) out[p] = u + (p * K + k) * C;
    transform_pairs<M>(g, out, C);
  }
}

template <int M>
void filter_gradient_t(const float* du, float* dw, int64_t C, int64_t K, float* dt) {
  constexpr int T = M + 2;
  // G^T du G for each input channel's K pairs (contiguous in du), into [r][s][c][k], then added
  // to dw[k][r][s][c].
  for (int64_t c = 0; c < C; ++c) {
    const float* d[T * T];
    for (int p = 0; p < T * T; ++p) d[p] = du + (p * C + c) * K;
    float* out[9];
    for (int t = 0; t < 9; ++t) out[t] = dt + (t * C + c) * K;
    for (int64_t k = 0; k < K; ++k) {
      float t[T][3];  // G^T du: column j of du in row j
      for (int j = 0; j < T; ++j) {
        float col[T];
        for (int i = 0; i < T; ++i) col[i] = d[i * T + j][k];
        Filter1d<M>::gt(col, t[j]);
      }
      for (int r = 0; r < 3; ++r) {
        float row[T], o[3];
        for (int j = 0; j < T; ++j) row[j] = t[j][r];
        Filter1d<M>::gt(row, o);
        for (int s = 0; s < 3; ++s) out[r * 3 + s][k] = o[s];
      }
    }
  }
  for (int64_t k = 0; k < K; ++k)
    for (int64_t t = 0; t < 9; ++t)
      for (int64_t c = 0; c < C; ++c) dw[(k * 9 + t) * C + c] += dt[(t * C + c) * K + k];
}
}  // namespace

int64_t transformed_floats(int64_t C, int64_t K, int m) { return int64_t(m + 2) * (m + 2) * C * K; }

void filter_forward(const float* w, float* u, int64_t C, int64_t K, float* tmp, int m) {
  check_tile(m);
  m == 4 ? filter_forward_t<4>(w, u, C, K, tmp) : filter_forward_t<2>(w, u, C, K, tmp);
}

void filter_backward_data(const float* w, float* u, int64_t C, int64_t K, float*, int m) {
  check_tile(m);
  m == 4 ? filter_backward_data_t<4>(w, u, C, K) : filter_backward_data_t<2>(w, u, C, K);
}

void filter_gradient(const float* du, float* dw, int64_t C, int64_t K, float* tmp, int m) {
  check_tile(m);
  m == 4 ? filter_gradient_t<4>(du, dw, C, K, tmp) : filter_gradient_t<2>(du, dw, C, K, tmp);
}

int64_t scratch_floats(int64_t C, int64_t K, int m) {
  return int64_t(m + 2) * (m + 2) * tile_block(C, K, m) * (C + K) + C;
}

#if defined(__AVX2__) && defined(__FMA__)
namespace {

// Forced inline for the reason direct_kernels.cpp gives: out of line, GCC 12 spills the
// accumulators on every step.
#define KERNEL inline __attribute__((always_inline))

// The data side's 1-D transforms on 8 channels at a time: in (B^T d, T values into T), out (A^T
// m, T into M) and grad (A y, M into T).
template <int M>
struct Tile1d;
template <>
struct Tile1d<2> {
  static KERNEL void in(const __m256* d, __m256* r) {
    r[0] = _mm256_sub_ps(d[0], d[2]);
    r[1] = _mm256_add_ps(d[1], d[2]);
    r[2] = _mm256_sub_ps(d[2], d[1]);
    r[3] = _mm256_sub_ps(d[1], d[3]);
  }
  static KERNEL void out(const __m256* m, __m256* o) {
    o[0] = _mm256_add_ps(_mm256_add_ps(m[0], m[1]), m[2]);
    o[1] = _mm256_sub_ps(_mm256_sub_ps(m[1], m[2]), m[3]);
  }
  static KERNEL void grad(const __m256* y, __m256* r) {
    r[0] = y[0];
    r[1] = _mm256_add_ps(y[0], y[1]);
    r[2] = _mm256_sub_ps(y[0], y[1]);
    r[3] = _mm256_sub_ps(_mm256_setzero_ps(), y[1]);
  }
};
template <>
struct Tile1d<4> {
  static KERNEL void in(const __m256* d, __m256* r) {
    const __m256 two = _mm256_set1_ps(2.f), four = _mm256_set1_ps(4.f), five = _mm256_set1_ps(5.f);
    r[0] = _mm256_fmadd_ps(four, d[0], _mm256_fnmadd_ps(five, d[2], d[4]));
    r[1] = _mm256_fnmadd_ps(four, _mm256_add_ps(d[1], d[2]), _mm256_add_ps(d[3], d[4]));
    r[2] = _mm256_fmadd_ps(four, _mm256_sub_ps(d[1], d[2]), _mm256_sub_ps(d[4], d[3]));
    const __m256 f = _mm256_sub_ps(d[3], d[1]), h = _mm256_sub_ps(d[4], d[2]);
    r[3] = _mm256_fmadd_ps(two, f, h);
    r[4] = _mm256_fnmadd_ps(two, f, h);
    r[5] = _mm256_fmadd_ps(four, d[1], _mm256_fnmadd_ps(five, d[3], d[5]));
  }
  static KERNEL void out(const __m256* m, __m256* o) {
    const __m256 a = _mm256_add_ps(m[1], m[2]), b = _mm256_add_ps(m[3], m[4]);
    const __m256 c = _mm256_sub_ps(m[1], m[2]), e = _mm256_sub_ps(m[3], m[4]);
    o[0] = _mm256_add_ps(_mm256_add_ps(m[0], a), b);
    o[1] = _mm256_fmadd_ps(_mm256_set1_ps(2.f), e, c);
    o[2] = _mm256_fmadd_ps(_mm256_set1_ps(4.f), b, a);
    o[3] = _mm256_add_ps(_mm256_fmadd_ps(_mm256_set1_ps(8.f), e, c), m[5]);
  }
  static KERNEL void grad(const __m256* y, __m256* r) {
    const __m256 a = _mm256_add_ps(y[0], y[2]), b = _mm256_add_ps(y[1], y[3]);
    const __m256 c = _mm256_fmadd_ps(_mm256_set1_ps(4.f), y[2], y[0]);
    const __m256 e = _mm256_mul_ps(_mm256_set1_ps(2.f), _mm256_fmadd_ps(_mm256_set1_ps(4.f), y[3], y[1]));
    r[0] = y[0];
    r[1] = _mm256_add_ps(a, b);
    r[2] = _mm256_sub_ps(a, b);
    r[3] = _mm256_add_ps(c, e);
    r[4] = _mm256_sub_ps(c, e);
    r[5] = y[3];
  }
};

// Where one tile sits: image n, tile row ti, tile column tj (its output rows M ti .. M ti + M - 1).
struct Tile {
  int64_t n, ti, tj;
};
struct TileGrid {
  int64_t H, W, M, TH, TW;
  TileGrid(int64_t H, int64_t W, int64_t M) : H(H), W(W), M(M), TH((H + M - 1) / M), TW((W + M - 1) / M) {}
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

// The input tile whose outputs start at (M ti, M tj): rows M ti - 1 .. M ti + M of the image,
// zero outside it; every 8 channels transformed (B^T d B) into v (position p = T i + j at v[p *
// vs]). Pixels outside the image read `zeros` (C floats), so the channel loop has no branch (on
// 7 x 7 and 14 x 14 images most tiles touch the border).
template <int M>
KERNEL void input_tile(const float* img, const TileGrid& g, int64_t C, const Tile& tl, const float* zeros, float* v,
                       int64_t vs) {
  constexpr int T = M + 2;
  const int64_t h0 = M * tl.ti - 1, w0 = M * tl.tj - 1;
  const float* src[T][T];
  if (h0 >= 0 && w0 >= 0 && h0 + T - 1 < g.H && w0 + T - 1 < g.W) {  // most tiles of a large image
    for (int i = 0; i < T; ++i)
      for (int j = 0; j < T; ++j) src[i][j] = img + ((h0 + i) * g.W + w0 + j) * C;
  } else {
    for (int i = 0; i < T; ++i)
      for (int j = 0; j < T; ++j) {
        const int64_t h = h0 + i, w = w0 + j;
        src[i][j] = h >= 0 && h < g.H && w >= 0 && w < g.W ? img + (h * g.W + w) * C : zeros;
      }
  }
  for (int64_t c0 = 0; c0 < C; c0 += 8) {
    __m256 t[T][T];  // B^T d: row i of the result in t[i]
    for (int j = 0; j < T; ++j) {
      __m256 col[T], r[T];
      for (int i = 0; i < T; ++i) col[i] = _mm256_loadu_ps(src[i][j] + c0);
      Tile1d<M>::in(col, r);
      for (int i = 0; i < T; ++i) t[i][j] = r[i];
    }
    for (int i = 0; i < T; ++i) {
      __m256 r[T];
      Tile1d<M>::in(t[i], r);
      for (int j = 0; j < T; ++j) _mm256_storeu_ps(v + (i * T + j) * vs + c0, r[j]);
    }
  }
}

// A^T m A of one tile's T^2 products (m[p * ms], every 8 channels), stored where the tile's
// M x M outputs lie inside the image.
template <int M>
KERNEL void output_tile(const float* m, int64_t ms, int64_t K, float* img, const TileGrid& g, const Tile& tl) {
  constexpr int T = M + 2;
  const int64_t h0 = M * tl.ti, w0 = M * tl.tj;
  const int mh = static_cast<int>(std::min<int64_t>(M, g.H - h0)), mw = static_cast<int>(std::min<int64_t>(M, g.W - w0));
  for (int64_t k0 = 0; k0 < K; k0 += 8) {
    __m256 t[M][T];  // A^T m: row a of the result in t[a]
    for (int j = 0; j < T; ++j) {
      __m256 col[T], o[M];
      for (int i = 0; i < T; ++i) col[i] = _mm256_loadu_ps(m + (i * T + j) * ms + k0);
      Tile1d<M>::out(col, o);
      for (int a = 0; a < M; ++a) t[a][j] = o[a];
    }
    for (int a = 0; a < mh; ++a) {
      __m256 o[M];
      Tile1d<M>::out(t[a], o);
      float* row = img + ((h0 + a) * g.W + w0) * K + k0;
      for (int b = 0; b < mw; ++b) _mm256_storeu_ps(row + b * K, o[b]);
    }
  }
}

// A dy A^T of one tile's M x M output gradient (zero outside the image), every 8 channels, into
// d[p * ds].
template <int M>
KERNEL void grad_tile(const float* dimg, const TileGrid& g, int64_t K, const Tile& tl, float* d, int64_t ds) {
  constexpr int T = M + 2;
  const int64_t h0 = M * tl.ti, w0 = M * tl.tj;
  const int mh = static_cast<int>(std::min<int64_t>(M, g.H - h0)), mw = static_cast<int>(std::min<int64_t>(M, g.W - w0));
  for (int64_t k0 = 0; k0 < K; k0 += 8) {
    __m256 y[M][M];
    for (int a = 0; a < M; ++a)
      for (int b = 0; b < M; ++b)
        y[a][b] = a < mh && b < mw ? _mm256_loadu_ps(dimg + ((h0 + a) * g.W + w0 + b) * K + k0) : _mm256_setzero_ps();
    __m256 t[T][M];  // A dy: row i of the result in t[i]
    for (int b = 0; b < M; ++b) {
      __m256 col[M], r[T];
      for (int a = 0; a < M; ++a) col[a] = y[a][b];
      Tile1d<M>::grad(col, r);
      for (int i = 0; i < T; ++i) t[i][b] = r[i];
    }
    for (int i = 0; i < T; ++i) {
      __m256 r[T];
      Tile1d<M>::grad(t[i], r);
      for (int j = 0; j < T; ++j) _mm256_storeu_ps(d + (i * T + j) * ds + k0, r[j]);
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

template <int M>
void forward_t(const float* x, int64_t N, int64_t H, int64_t W, int64_t C, const float* u, int64_t K, float* y,
               float* scratch) {
  constexpr int P = (M + 2) * (M + 2);
  const TileGrid g(H, W, M);
  const int64_t TB = tile_block(C, K, M), T = N * g.TH * g.TW;
  float* v = scratch;               // P x TB x C
  float* m = scratch + P * TB * C;  // P x TB x K
  float* zeros = m + P * TB * K;
  std::fill(zeros, zeros + C, 0.f);
  for (int64_t t0 = 0; t0 < T; t0 += TB) {
    const int64_t tb = std::min(TB, T - t0);
    const Tile first = g.at(t0);
    Tile tl = first;
    for (int64_t i = 0; i < tb; ++i, g.next(tl))
      input_tile<M>(x + tl.n * H * W * C, g, C, tl, zeros, v + i * C, TB * C);
    for (int p = 0; p < P; ++p) gemm(v + p * TB * C, tb, C, u + p * C * K, K, m + p * TB * K);
    tl = first;
    for (int64_t i = 0; i < tb; ++i, g.next(tl)) output_tile<M>(m + i * K, TB * K, K, y + tl.n * H * W * K, g, tl);
  }
}

template <int M>
void backward_filter_t(const float* x, const float* dy, int64_t N, int64_t H, int64_t W, int64_t C, int64_t K,
                       float* du, float* scratch) {
  constexpr int P = (M + 2) * (M + 2);
  const TileGrid g(H, W, M);
  const int64_t TB = tile_block(C, K, M), T = N * g.TH * g.TW;
  float* v = scratch;               // P x TB x C
  float* d = scratch + P * TB * C;  // P x TB x K
  float* zeros = d + P * TB * K;
  std::fill(zeros, zeros + C, 0.f);
  for (int64_t t0 = 0; t0 < T; t0 += TB) {
    const int64_t tb = std::min(TB, T - t0);
    Tile tl = g.at(t0);
    for (int64_t i = 0; i < tb; ++i, g.next(tl)) {
      input_tile<M>(x + tl.n * H * W * C, g, C, tl, zeros, v + i * C, TB * C);
      grad_tile<M>(dy + tl.n * H * W * K, g, K, tl, d + i * K, TB * K);
    }
    for (int p = 0; p < P; ++p) gemm_tn(v + p * TB * C, tb, C, d + p * TB * K, K, du + p * C * K);
  }
}

}  // namespace

void forward(const float* x, int64_t N, int64_t H, int64_t W, int64_t C, const float* u, int64_t K, float* y,
             float* scratch, int m) {
  check_tile(m);
  m == 4 ? forward_t<4>(x, N, H, W, C, u, K, y, scratch) : forward_t<2>(x, N, H, W, C, u, K, y, scratch);
}

void backward_filter(const float* x, const float* dy, int64_t N, int64_t H, int64_t W, int64_t C, int64_t K,
                     float* du, float* scratch, int m) {
  check_tile(m);
  m == 4 ? backward_filter_t<4>(x, dy, N, H, W, C, K, du, scratch) : backward_filter_t<2>(x, dy, N, H, W, C, K, du, scratch);
}

#undef KERNEL
#else
void forward(const float*, int64_t, int64_t, int64_t, int64_t, const float*, int64_t, float*, float*, int) {
  throw Error("Winograd convolution: the baseline kernel copy has no Winograd kernels");  // conv.cpp never calls them here
}
void backward_filter(const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t, float*, float*, int) {
  throw Error("Winograd convolution: the baseline kernel copy has no Winograd kernels");
}
#endif

}  // namespace replica::ops::REPLICA_CPU_ISA_NS::winograd
