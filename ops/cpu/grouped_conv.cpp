// Grouped convolution on NHWC (ConvGeom::groups > 1: ResNeXt's 3x3 layers), groups side by side.
// Group g's input channels are the contiguous slice [g Cg, (g + 1) Cg) of each pixel and its
// outputs [g Kg, (g + 1) Kg). Each image's input is expanded so that input channel c of every
// group lines up with that group's Kg outputs (xe[h][w][c][k] = x[h][w][group(k) Cg + c]) and the
// filter re-laid to [r][s][c][k]: every pass is then a multiply-add over all K output channels,
// contiguous and vectorised by the compiler at each ISA level, where a loop over one group's 4 or
// 8 channels would waste most of a vector. Whole images per task on the replica's intra-op
// threads; the weight gradient sums one partial per thread in thread order (deterministic for a
// given thread count, as the other paths). 16-bit tensors go through run_in_f32.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "core/errors.h"
#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/grouped_conv.h"
#include "ops/cpu/mixed.h"
#include "ops/cpu/parallel_for.h"
#include "ops/cpu/threads.h"

namespace replica::ops::REPLICA_CPU_ISA_NS::grouped {
namespace {

struct Buffer {  // f32 scratch from the pool (tag workspace)
  Buffer(MemoryPool& pool, int64_t floats)
      : pool(pool), p(static_cast<float*>(pool.allocate(static_cast<size_t>(std::max<int64_t>(floats, 1)) * sizeof(float),
                                                         MemTag::workspace))) {}
  ~Buffer() { pool.deallocate(p); }
  MemoryPool& pool;
  float* p;
};

int threads_for(int64_t N) { return std::min<int>(intra_op_threads(), static_cast<int>(N)); }

// One scratch buffer of `floats` per thread (zeroed when asked).
std::vector<std::unique_ptr<Buffer>> per_thread(MemoryPool& ws, int threads, int64_t floats, bool zero = false) {
  std::vector<std::unique_ptr<Buffer>> out;
  for (int t = 0; t < threads; ++t) {
    out.push_back(std::make_unique<Buffer>(ws, floats));
    if (zero) std::memset(out.back()->p, 0, static_cast<size_t>(floats) * sizeof(float));
  }
  return out;
}

// Output pixel (p, q)'s window rows and columns that fall inside the image.
struct Window {
  int64_t r0, r1, s0, s1, h0, w0;
  Window(const ConvGeom& g, int64_t p, int64_t q) {
    h0 = p * g.stride - g.pad;
    w0 = q * g.stride - g.pad;
    r0 = std::max<int64_t>(0, -h0);
    r1 = std::min<int64_t>(g.R, g.H - h0);
    s0 = std::max<int64_t>(0, -w0);
    s1 = std::min<int64_t>(g.S, g.W - w0);
  }
};

// The input seen per group, expanded so that every pass is a contiguous multiply-add over all K
// output channels: xe[h][w][c][k] = x[h][w][group(k) Cg + c] (c < Cg, group(k) = k / Kg). One
// image, H x W x Cg x K floats (Cg / Kg times the input: 1 for ResNeXt).
void expand(const float* img, float* xe, const ConvGeom& g) {
  const int64_t G = g.groups, Cg = g.C / G, Kg = g.K / G;
  for (int64_t px = 0; px < g.H * g.W; ++px) {
    const float* in = img + px * g.C;
    float* o = xe + px * Cg * g.K;
    for (int64_t c = 0; c < Cg; ++c)
      for (int64_t gi = 0; gi < G; ++gi) std::fill_n(o + c * g.K + gi * Kg, Kg, in[gi * Cg + c]);
  }
}

// wt[r][s][c][k] = w[k][r][s][c]: a filter tap's weights for input channel c of every group, in
// output-channel order.
void relay_filter(const float* w, float* wt, const ConvGeom& g) {
  const int64_t Cg = g.filter_channels();
  for (int64_t k = 0; k < g.K; ++k)
    for (int64_t r = 0; r < g.R; ++r)
      for (int64_t s = 0; s < g.S; ++s)
        for (int64_t c = 0; c < Cg; ++c) wt[((r * g.S + s) * Cg + c) * g.K + k] = w[((k * g.R + r) * g.S + s) * Cg + c];
}

inline void fma_rows(float* __restrict acc, const float* __restrict a, const float* __restrict b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += a[i] * b[i];
}

// The register block: 32 output channels (four 256-bit or two 512-bit accumulators).
constexpr int64_t kBlock = 32;
inline void fma_block(float (&acc)[kBlock], const float* __restrict a, const float* __restrict b) {
  for (int64_t i = 0; i < kBlock; ++i) acc[i] += a[i] * b[i];
}

void forward_f32(const float* x, const float* w, float* y, const ConvGeom& g, MemoryPool& ws) {
  const int64_t Cg = g.filter_channels(), CK = Cg * g.K;
  Buffer wt(ws, g.R * g.S * CK);
  relay_filter(w, wt.p, g);
  const int T = threads_for(g.N);
  const auto xe = per_thread(ws, T, g.H * g.W * CK);
  parallel_for(g.N, T, [&](int64_t n, int t) {
    float* e = xe[t]->p;
    expand(x + n * g.H * g.W * g.C, e, g);
    for (int64_t p = 0; p < g.P; ++p)
      for (int64_t q = 0; q < g.Q; ++q) {
        float* out = y + ((n * g.P + p) * g.Q + q) * g.K;
        const Window win(g, p, q);
        // A block of output channels accumulates in registers over the whole window; the tail
        // (K not a multiple of the block) row by row.
        int64_t kb = 0;
        for (; kb + kBlock <= g.K; kb += kBlock) {
          float acc[kBlock] = {};
          for (int64_t r = win.r0; r < win.r1; ++r)
            for (int64_t s = win.s0; s < win.s1; ++s) {
              const float* pix = e + ((win.h0 + r) * g.W + win.w0 + s) * CK + kb;
              const float* tap = wt.p + (r * g.S + s) * CK + kb;
              for (int64_t c = 0; c < Cg; ++c) fma_block(acc, pix + c * g.K, tap + c * g.K);
            }
          std::copy_n(acc, kBlock, out + kb);
        }
        if (kb < g.K) {
          std::fill(out + kb, out + g.K, 0.f);
          for (int64_t r = win.r0; r < win.r1; ++r)
            for (int64_t s = win.s0; s < win.s1; ++s) {
              const float* pix = e + ((win.h0 + r) * g.W + win.w0 + s) * CK;
              const float* tap = wt.p + (r * g.S + s) * CK;
              for (int64_t c = 0; c < Cg; ++c) fma_rows(out + kb, pix + c * g.K + kb, tap + c * g.K + kb, g.K - kb);
            }
        }
      }
  });
}

// dxe[h][w][c][k] += dy[p][q][k] wt[r][s][c][k] over the windows, then each group's Kg terms
// summed into dx[h][w][g Cg + c].
void backward_data_f32(const float* dy, const float* w, float* dx, const ConvGeom& g, MemoryPool& ws) {
  const int64_t G = g.groups, Cg = g.filter_channels(), Kg = g.K / G, CK = Cg * g.K;
  Buffer wt(ws, g.R * g.S * CK);
  relay_filter(w, wt.p, g);
  const int T = threads_for(g.N);
  const auto dxe = per_thread(ws, T, g.H * g.W * CK);
  parallel_for(g.N, T, [&](int64_t n, int t) {
    float* e = dxe[t]->p;
    std::fill(e, e + g.H * g.W * CK, 0.f);
    for (int64_t p = 0; p < g.P; ++p)
      for (int64_t q = 0; q < g.Q; ++q) {
        const float* d = dy + ((n * g.P + p) * g.Q + q) * g.K;
        const Window win(g, p, q);
        for (int64_t r = win.r0; r < win.r1; ++r)
          for (int64_t s = win.s0; s < win.s1; ++s) {
            float* pix = e + ((win.h0 + r) * g.W + win.w0 + s) * CK;
            const float* tap = wt.p + (r * g.S + s) * CK;
            for (int64_t c = 0; c < Cg; ++c) fma_rows(pix + c * g.K, d, tap + c * g.K, g.K);
          }
      }
    float* img = dx + n * g.H * g.W * g.C;
    for (int64_t px = 0; px < g.H * g.W; ++px)
      for (int64_t gi = 0; gi < G; ++gi)
        for (int64_t c = 0; c < Cg; ++c) {
          const float* v = e + px * CK + c * g.K + gi * Kg;
          float sum = 0.f;
          for (int64_t j = 0; j < Kg; ++j) sum += v[j];
          img[px * g.C + gi * Cg + c] = sum;
        }
  });
}

// dwt[r][s][c][k] += xe[h][w][c][k] dy[p][q][k]: one partial per thread, summed in thread order
// and re-laid into KRSC.
void backward_filter_f32(const float* x, const float* dy, float* dw, const ConvGeom& g, MemoryPool& ws) {
  const int64_t Cg = g.filter_channels(), CK = Cg * g.K, RSCK = g.R * g.S * CK;
  const int T = threads_for(g.N);
  const auto partial = per_thread(ws, T, RSCK, /*zero=*/true), xe = per_thread(ws, T, g.H * g.W * CK);
  parallel_for(g.N, T, [&](int64_t n, int t) {
    float* e = xe[t]->p;
    expand(x + n * g.H * g.W * g.C, e, g);
    float* acc = partial[t]->p;
    for (int64_t p = 0; p < g.P; ++p)
      for (int64_t q = 0; q < g.Q; ++q) {
        const float* d = dy + ((n * g.P + p) * g.Q + q) * g.K;
        const Window win(g, p, q);
        for (int64_t r = win.r0; r < win.r1; ++r)
          for (int64_t s = win.s0; s < win.s1; ++s) {
            const float* pix = e + ((win.h0 + r) * g.W + win.w0 + s) * CK;
            float* tap = acc + (r * g.S + s) * CK;
            for (int64_t c = 0; c < Cg; ++c) fma_rows(tap + c * g.K, pix + c * g.K, d, g.K);
          }
      }
  });
  for (int t = 0; t < T; ++t) {
    const float* part = partial[t]->p;
    for (int64_t k = 0; k < g.K; ++k)
      for (int64_t r = 0; r < g.R; ++r)
        for (int64_t s = 0; s < g.S; ++s)
          for (int64_t c = 0; c < Cg; ++c)
            dw[((k * g.R + r) * g.S + s) * Cg + c] += part[((r * g.S + s) * Cg + c) * g.K + k];
  }
}

}  // namespace

void forward(const Tensor& x, const Tensor& w, const Tensor& y, const ConvGeom& g, MemoryPool& ws) {
  if (run_in_f32({In(x), In(w), Out(y)}, [&](auto& t) { forward(t[0], t[1], t[2], g, ws); })) return;
  forward_f32(x.data<float>(), w.data<float>(), y.data<float>(), g, ws);
}

void backward_data(const Tensor& dy, const Tensor& w, const Tensor& dx, const ConvGeom& g, MemoryPool& ws) {
  if (run_in_f32({In(dy), In(w), Out(dx)}, [&](auto& t) { backward_data(t[0], t[1], t[2], g, ws); })) return;
  backward_data_f32(dy.data<float>(), w.data<float>(), dx.data<float>(), g, ws);
}

void backward_filter(const Tensor& x, const Tensor& dy, const Tensor& dw, const ConvGeom& g, MemoryPool& ws) {
  if (run_in_f32({In(x), In(dy), InOut(dw)}, [&](auto& t) { backward_filter(t[0], t[1], t[2], g, ws); })) return;
  backward_filter_f32(x.data<float>(), dy.data<float>(), dw.data<float>(), g, ws);
}

}  // namespace replica::ops::REPLICA_CPU_ISA_NS::grouped
