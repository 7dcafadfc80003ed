// CPU convolution on NHWC: the direct kernel (direct_conv.h) where it serves the geometry, else
// im2col + Eigen GEMM, a batch chunk at a time so the column buffer (from the pool, tag
// workspace) stays cache-sized; chunks spread over the replica's intra-op threads. 1x1 stride-1
// unpadded convolutions skip im2col: the input already is the column matrix.
// 16-bit activations are converted a chunk at a time too (ChunkView).
#include <Eigen/Core>
#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "core/errors.h"
#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/direct_conv.h"
#include "ops/cpu/direct_kernels.h"
#include "ops/cpu/grouped_conv.h"
#include "ops/cpu/mixed.h"
#include "ops/cpu/parallel_for.h"
#include "ops/cpu/threads.h"
#include "ops/cpu/winograd_kernels.h"

namespace replica::ops::REPLICA_CPU_ISA_NS {
namespace {

using MatR = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MapR = Eigen::Map<MatR>;
using CMapR = Eigen::Map<const MatR>;

// 1 MiB of columns per chunk keeps the packed GEMM operands in L2: measured 1.25x faster than
// 4 MiB on ResNet-20 (bench/RESULTS.md).
constexpr size_t kColBytes = size_t(1) << 20;

// The baseline copy has no direct kernels (direct_kernels.h); direct::serves_* cannot know which
// copy asks.
constexpr bool kHasDirect = kIsa >= CpuIsa::avx2;

bool is_pointwise(const ConvGeom& g) { return g.R == 1 && g.S == 1 && g.stride == 1 && g.pad == 0; }

int64_t chunk_images(const ConvGeom& g) {
  size_t per_image = static_cast<size_t>(g.P * g.Q * g.R * g.S * g.C) * sizeof(float);
  return std::clamp<int64_t>(static_cast<int64_t>(kColBytes / std::max<size_t>(per_image, 1)), 1, g.N);
}

// Rows are output pixels (n,p,q); columns are (r,s,c), matching KRSC filters. x: the chunk's
// first image.
void im2col(const float* x, float* col, const ConvGeom& g, int64_t nb) {
  const int64_t SC = g.S * g.C, RSC = g.R * SC;
  for (int64_t n = 0; n < nb; ++n) {
    const float* img = x + n * g.H * g.W * g.C;
    for (int64_t p = 0; p < g.P; ++p) {
      for (int64_t q = 0; q < g.Q; ++q) {
        float* row = col + ((n * g.P + p) * g.Q + q) * RSC;
        const int64_t w0 = q * g.stride - g.pad;
        const int64_t s_lo = std::max<int64_t>(0, -w0), s_hi = std::min<int64_t>(g.S, g.W - w0);
        for (int64_t r = 0; r < g.R; ++r) {
          float* dst = row + r * SC;
          const int64_t h = p * g.stride - g.pad + r;
          if (h < 0 || h >= g.H || s_lo >= s_hi) {
            std::memset(dst, 0, SC * sizeof(float));
            continue;
          }
          if (s_lo > 0) std::memset(dst, 0, s_lo * g.C * sizeof(float));
          std::memcpy(dst + s_lo * g.C, img + (h * g.W + w0 + s_lo) * g.C,
                      (s_hi - s_lo) * g.C * sizeof(float));
          if (s_hi < g.S) std::memset(dst + s_hi * g.C, 0, (g.S - s_hi) * g.C * sizeof(float));
        }
      }
    }
  }
}

// Adds the column matrix back into dx (the chunk's first image; the caller zeroed it).
void col2im(const float* col, float* dx, const ConvGeom& g, int64_t nb) {
  const int64_t SC = g.S * g.C, RSC = g.R * SC;
  for (int64_t n = 0; n < nb; ++n) {
    float* img = dx + n * g.H * g.W * g.C;
    for (int64_t p = 0; p < g.P; ++p) {
      for (int64_t q = 0; q < g.Q; ++q) {
        const float* row = col + ((n * g.P + p) * g.Q + q) * RSC;
        const int64_t w0 = q * g.stride - g.pad;
        const int64_t s_lo = std::max<int64_t>(0, -w0), s_hi = std::min<int64_t>(g.S, g.W - w0);
        for (int64_t r = 0; r < g.R; ++r) {
          const int64_t h = p * g.stride - g.pad + r;
          if (h < 0 || h >= g.H || s_lo >= s_hi) continue;
          const float* src = row + r * SC + s_lo * g.C;
          float* dst = img + (h * g.W + w0 + s_lo) * g.C;
          const int64_t len = (s_hi - s_lo) * g.C;
          for (int64_t i = 0; i < len; ++i) dst[i] += src[i];
        }
      }
    }
  }
}

void check_conv(const Tensor& x, const Tensor& w, const Tensor& y, const ConvGeom& g, const char* who) {
  for (const Tensor* t : {&x, &w, &y})
    if (t->dtype() != DType::f32 && t->dtype() != DType::f16 && t->dtype() != DType::bf16)
      throw ShapeError(std::string(who) + ": expected f32, f16 or bf16, got " + t->str());
  if (x.numel() != g.N * g.H * g.W * g.C || w.numel() != g.K * g.R * g.S * g.filter_channels() ||
      y.numel() != g.N * g.P * g.Q * g.K)
    throw ShapeError(std::string(who) + ": tensors " + x.str() + ", " + w.str() + ", " + y.str() +
                     " do not match the convolution geometry");
}

struct Workspace {
  Workspace(MemoryPool& pool, size_t bytes) : pool(pool), p(static_cast<float*>(pool.allocate(bytes, MemTag::workspace))) {}
  ~Workspace() { pool.deallocate(p); }
  MemoryPool& pool;
  float* p;
};

// Runs fn(chunk, thread) over the batch chunks, on the replica's intra-op threads when it has
// more than one (chunks are whole images, so threads never write the same output).
template <typename F>
void for_chunks(int64_t nchunks, int threads, F&& fn) {
  parallel_for(nchunks, threads, fn);
}

// The chunking every convolution pass shares: chunk size, thread count, and one column buffer per
// thread (none for the pointwise fast path).
struct ChunkPlan {
  // columns: false for the direct kernels, which need no column buffer.
  ChunkPlan(const ConvGeom& g, MemoryPool& ws, bool columns = true)
      : RSC(g.R * g.S * g.C), PQ(g.P * g.Q), chunk(chunk_images(g)), nchunks((g.N + chunk - 1) / chunk),
        threads(std::min<int>(intra_op_threads(), static_cast<int>(nchunks))), pointwise(is_pointwise(g)) {
    for (int t = 0; t < (pointwise || !columns ? 0 : threads); ++t)
      cols.push_back(std::make_unique<Workspace>(ws, static_cast<size_t>(chunk * PQ * RSC) * sizeof(float)));
  }
  float* col(int thread) const { return cols[thread]->p; }
  const int64_t RSC, PQ, chunk, nchunks;
  const int threads;
  const bool pointwise;
  std::vector<std::unique_ptr<Workspace>> cols;
};

// An activation operand seen a batch chunk at a time in f32. f32 tensors are used in place;
// 16-bit ones are converted chunk by chunk into a per-thread buffer (tag workspace) that stays
// in cache, and outputs are rounded back chunk by chunk: run_in_f32's arithmetic exactly, without
// a whole-tensor f32 copy written to memory and read back.
class ChunkView {
 public:
  enum Role { in, out };
  ChunkView(const Tensor& t, int64_t per_image, const ChunkPlan& cp, MemoryPool& ws, Role role)
      : t_(t), per_image_(per_image), role_(role) {
    if (t.dtype() == DType::f32) return;
    for (int i = 0; i < cp.threads; ++i)
      bufs_.push_back(std::make_unique<Workspace>(ws, static_cast<size_t>(cp.chunk * per_image) * sizeof(float)));
  }
  // Images [n0, n0 + nb) in f32 (converted in for an input).
  float* get(int64_t n0, int64_t nb, int thread) {
    if (bufs_.empty()) return t_.data<float>() + n0 * per_image_;
    float* b = bufs_[thread]->p;
    if (role_ == in) convert(element(n0), t_.dtype(), b, DType::f32, static_cast<size_t>(nb * per_image_));
    return b;
  }
  // An output's chunk back into its 16-bit storage.
  void put(int64_t n0, int64_t nb, int thread) {
    if (bufs_.empty()) return;
    convert(bufs_[thread]->p, DType::f32, element(n0), t_.dtype(), static_cast<size_t>(nb * per_image_));
  }

 private:
  char* element(int64_t n0) const {
    return static_cast<char*>(t_.raw()) + static_cast<size_t>(n0 * per_image_) * dtype_size(t_.dtype());
  }
  const Tensor& t_;
  int64_t per_image_;
  Role role_;
  std::vector<std::unique_ptr<Workspace>> bufs_;
};

// A filter (small) in f32: itself, or a converted copy.
Tensor filter_f32(const Tensor& w, MemoryPool& ws) {
  if (w.dtype() == DType::f32) return w;
  Tensor f = Tensor::empty(ws, w.shape(), DType::f32, MemTag::workspace);
  convert(w.raw(), w.dtype(), f.raw(), DType::f32, static_cast<size_t>(w.numel()));
  return f;
}

// An input activation one image at a time as the direct kernels read it: f32 and zero-padded
// (one buffer per thread, its border cleared once). A 16-bit image is converted straight into
// the padded buffer row by row, so it is written once and read from cache, not converted into a
// chunk buffer and copied again. An unpadded f32 image is read in place.
class KernelImages {
 public:
  KernelImages(const Tensor& t, const direct::PaddedGeom& pg, int threads, MemoryPool& ws)
      : pg(pg), t_(t), image_(pg.H * pg.W * pg.C) {
    if (!pg.pad && t.dtype() == DType::f32) return;
    for (int i = 0; i < threads; ++i) {
      bufs_.push_back(std::make_unique<Workspace>(ws, static_cast<size_t>(pg.floats()) * sizeof(float)));
      if (pg.pad) std::memset(bufs_.back()->p, 0, static_cast<size_t>(pg.floats()) * sizeof(float));
    }
  }
  const float* get(int64_t n, int thread) const {
    if (bufs_.empty()) return t_.data<float>() + n * image_;
    const size_t esize = dtype_size(t_.dtype());
    const char* src = static_cast<const char*>(t_.raw()) + static_cast<size_t>(n * image_) * esize;
    float* dst = bufs_[thread]->p;
    if (!pg.pad) {  // a 16-bit image without padding: contiguous, one conversion
      convert(src, t_.dtype(), dst, DType::f32, static_cast<size_t>(image_));
      return dst;
    }
    const int64_t row = pg.W * pg.C;
    for (int64_t h = 0; h < pg.H; ++h)
      convert(src + static_cast<size_t>(h * row) * esize, t_.dtype(), dst + ((h + pg.pad) * pg.Wp() + pg.pad) * pg.C,
              DType::f32, static_cast<size_t>(row));
    return dst;
  }
  const direct::PaddedGeom pg;

 private:
  const Tensor& t_;
  const int64_t image_;
  std::vector<std::unique_ptr<Workspace>> bufs_;
};

// One pass of the direct kernel over the batch, a chunk of images per task as the GEMM path:
// `in` (images of pg.H x pg.W x pg.C, padded by pg.pad) convolved with the filter `pack` lays out
// into `out` (images of P x Q x K). The forward pass and stride-1 backward data are both one.
struct DirectPass {
  direct::PaddedGeom pg;
  int64_t K, stride, P, Q;
  void (*pack)(const float*, float*, const ConvGeom&);
};

void run_direct(const Tensor& in, const Tensor& w, const Tensor& out, const DirectPass& d, const ConvGeom& g,
                MemoryPool& ws) {
  const ChunkPlan cp(g, ws, false);
  const int64_t out_image = d.P * d.Q * d.K;
  const Tensor wf = filter_f32(w, ws);
  Workspace packed(ws, static_cast<size_t>(g.K * cp.RSC) * sizeof(float));
  d.pack(wf.data<float>(), packed.p, g);
  const KernelImages I(in, d.pg, cp.threads, ws);
  ChunkView O(out, out_image, cp, ws, ChunkView::out);
  for_chunks(cp.nchunks, cp.threads, [&](int64_t c, int t) {
    const int64_t n0 = c * cp.chunk, nb = std::min(cp.chunk, g.N - n0);
    for (int64_t n = n0; n < n0 + nb; ++n) {  // a 16-bit output is rounded back while in cache
      float* o = O.get(n, 1, t);
      direct_kernels::forward_image(I.get(n, t), d.pg.Wp(), d.pg.C, packed.p, d.K, g.R, g.S, d.stride, d.P, d.Q, o);
      O.put(n, 1, t);
    }
  });
}

void direct_forward(const Tensor& x, const Tensor& w, const Tensor& y, const ConvGeom& g, MemoryPool& ws) {
  run_direct(x, w, y, {{g.H, g.W, g.C, g.pad}, g.K, g.stride, g.P, g.Q, direct::pack_forward}, g, ws);
}

// Stride-1 backward data: dx is the forward convolution of dy, padded by R - 1 - pad, with the
// flipped filter whose input and output channels are swapped.
void direct_backward_data(const Tensor& dy, const Tensor& w, const Tensor& dx, const ConvGeom& g, MemoryPool& ws) {
  run_direct(dy, w, dx, {{g.P, g.Q, g.K, g.R - 1 - g.pad}, g.C, 1, g.H, g.W, direct::pack_backward_data}, g, ws);
}

// Backward filter by the direct kernel: one RSCK partial per thread (zeroed), each image's
// gradient accumulated into its thread's, then added to dw in thread order (deterministic for a
// given thread count, as the GEMM path).
void direct_backward_filter(const Tensor& x, const Tensor& dy, const Tensor& dw, const ConvGeom& g, MemoryPool& ws) {
  const ChunkPlan cp(g, ws, false);
  const int64_t KRSC = g.K * cp.RSC;
  std::vector<std::unique_ptr<Workspace>> partial;
  for (int t = 0; t < cp.threads; ++t) {
    partial.push_back(std::make_unique<Workspace>(ws, static_cast<size_t>(KRSC) * sizeof(float)));
    std::memset(partial.back()->p, 0, static_cast<size_t>(KRSC) * sizeof(float));
  }
  const KernelImages X(x, {g.H, g.W, g.C, g.pad}, cp.threads, ws), DY(dy, {g.P, g.Q, g.K, 0}, cp.threads, ws);
  for_chunks(cp.nchunks, cp.threads, [&](int64_t c, int t) {
    const int64_t n0 = c * cp.chunk, nb = std::min(cp.chunk, g.N - n0);
    for (int64_t n = n0; n < n0 + nb; ++n)
      direct_kernels::backward_filter_image(X.get(n, t), X.pg.Wp(), g.C, DY.get(n, t), g.K, g.R, g.S, g.stride, g.P, g.Q,
                                    partial[t]->p);
  });
  float* out = dw.data<float>();
  for (int t = 0; t < cp.threads; ++t) {
    const float* part = partial[t]->p;  // RSC x K
    for (int64_t k = 0; k < g.K; ++k)
      for (int64_t i = 0; i < cp.RSC; ++i) out[k * cp.RSC + i] += part[i * g.K + k];
  }
}

// Winograd F(m x m, 3x3) (winograd_kernels.h): `in` (N x H x W x Cin, zero border of 1 implied,
// no padded copy) into `out` (N x H x W x Kout) with the transformed filter `transform` makes, a
// chunk of images per task; the forward pass and backward data are both one.
void run_winograd(const Tensor& in, int64_t Cin, const Tensor& w, const Tensor& out, int64_t Kout,
                  void (*transform)(const float*, float*, int64_t, int64_t, float*, int), int m, const ConvGeom& g,
                  MemoryPool& ws) {
  const ChunkPlan cp(g, ws, false);
  const Tensor wf = filter_f32(w, ws);
  Workspace u(ws, static_cast<size_t>(winograd::transformed_floats(Cin, Kout, m)) * sizeof(float));
  {  // the forward transform's transposed copy (backward data reads the filter in place)
    std::optional<Workspace> tmp;
    if (transform != winograd::filter_backward_data) tmp.emplace(ws, static_cast<size_t>(9 * g.C * g.K) * sizeof(float));
    transform(wf.data<float>(), u.p, g.C, g.K, tmp ? tmp->p : nullptr, m);
  }
  ChunkView I(in, g.H * g.W * Cin, cp, ws, ChunkView::in), O(out, g.H * g.W * Kout, cp, ws, ChunkView::out);
  std::vector<std::unique_ptr<Workspace>> scratch;
  for (int t = 0; t < cp.threads; ++t)
    scratch.push_back(std::make_unique<Workspace>(ws, static_cast<size_t>(winograd::scratch_floats(Cin, Kout, m)) * sizeof(float)));
  for_chunks(cp.nchunks, cp.threads, [&](int64_t c, int t) {
    const int64_t n0 = c * cp.chunk, nb = std::min(cp.chunk, g.N - n0);
    winograd::forward(I.get(n0, nb, t), nb, g.H, g.W, Cin, u.p, Kout, O.get(n0, nb, t), scratch[t]->p, m);
    O.put(n0, nb, t);
  });
}

// The Winograd weight gradient: one transformed-domain partial ((m + 2)^2 x C x K) per thread, zeroed,
// each chunk's tiles accumulated into its thread's; the partials are brought back to KRSC and
// added to dw in thread order (deterministic for a given thread count, as the other paths).
void winograd_backward_filter(const Tensor& x, const Tensor& dy, const Tensor& dw, int m, const ConvGeom& g,
                              MemoryPool& ws) {
  const ChunkPlan cp(g, ws, false);
  const size_t du_floats = static_cast<size_t>(winograd::transformed_floats(g.C, g.K, m));
  ChunkView X(x, g.H * g.W * g.C, cp, ws, ChunkView::in), DY(dy, g.H * g.W * g.K, cp, ws, ChunkView::in);
  std::vector<std::unique_ptr<Workspace>> partial, scratch;
  for (int t = 0; t < cp.threads; ++t) {
    partial.push_back(std::make_unique<Workspace>(ws, du_floats * sizeof(float)));
    std::memset(partial.back()->p, 0, du_floats * sizeof(float));
    scratch.push_back(std::make_unique<Workspace>(ws, static_cast<size_t>(winograd::scratch_floats(g.C, g.K, m)) * sizeof(float)));
  }
  for_chunks(cp.nchunks, cp.threads, [&](int64_t c, int t) {
    const int64_t n0 = c * cp.chunk, nb = std::min(cp.chunk, g.N - n0);
    winograd::backward_filter(X.get(n0, nb, t), DY.get(n0, nb, t), nb, g.H, g.W, g.C, g.K, partial[t]->p, scratch[t]->p, m);
  });
  Workspace tmp(ws, static_cast<size_t>(9 * g.C * g.K) * sizeof(float));
  for (int t = 0; t < cp.threads; ++t) winograd::filter_gradient(partial[t]->p, dw.data<float>(), g.C, g.K, tmp.p, m);
}

}  // namespace

// Each convolution walks the batch in chunks of whole images: im2col of the chunk into a
// per-thread column buffer (from the pool, tag workspace), then one GEMM. 1x1 stride-1 unpadded
// convolutions use the input rows directly.
void CpuBackend::conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& y, const ConvGeom& g,
                                MemoryPool& ws) {
  apply_thread_default();
  check_conv(x, w, y, g, "conv2d_forward");
  if (g.groups > 1) return grouped::forward(x, w, y, g, ws);
  if (const int m = kHasDirect ? direct::winograd_tile(g) : 0)
    return run_winograd(x, g.C, w, y, g.K, winograd::filter_forward, m, g, ws);
  if (kHasDirect && direct::serves_forward(g)) return direct_forward(x, w, y, g, ws);
  const ChunkPlan cp(g, ws);
  const int64_t RSC = cp.RSC, PQ = cp.PQ, chunk = cp.chunk;
  const Tensor wf = filter_f32(w, ws);
  ChunkView X(x, g.H * g.W * g.C, cp, ws, ChunkView::in), Y(y, PQ * g.K, cp, ws, ChunkView::out);
  CMapR W(wf.data<float>(), g.K, RSC);
  for_chunks(cp.nchunks, cp.threads, [&](int64_t c, int t) {
    const int64_t n0 = c * chunk, nb = std::min(chunk, g.N - n0);
    const float* a = X.get(n0, nb, t);
    if (!cp.pointwise) {
      im2col(a, cp.col(t), g, nb);
      a = cp.col(t);
    }
    MapR(Y.get(n0, nb, t), nb * PQ, g.K).noalias() = CMapR(a, nb * PQ, RSC) * W.transpose();
    Y.put(n0, nb, t);
  });
}

void CpuBackend::conv2d_backward_data(const Tensor& dy, const Tensor& w, const Tensor& dx,
                                      const ConvGeom& g, MemoryPool& ws, bool accumulate) {
  apply_thread_default();
  check_conv(dx, w, dy, g, "conv2d_backward_data");
  if (accumulate) {
    // Into a workspace, then one add: the same bits as computing dx and adding the other term
    // after (an unfused residual block), which the kernels' own accumulation orders would not give.
    const Tensor part = Tensor::empty(ws, dx.shape(), dx.dtype(), MemTag::workspace);
    conv2d_backward_data(dy, w, part, g, ws, false);
    axpy(1.f, part, dx);
    return;
  }
  if (g.groups > 1) return grouped::backward_data(dy, w, dx, g, ws);
  if (const int m = kHasDirect ? direct::winograd_tile(g) : 0)
    return run_winograd(dy, g.K, w, dx, g.C, winograd::filter_backward_data, m, g, ws);
  if (kHasDirect && direct::serves_backward_data(g)) return direct_backward_data(dy, w, dx, g, ws);
  const ChunkPlan cp(g, ws);
  const int64_t RSC = cp.RSC, PQ = cp.PQ, chunk = cp.chunk, HWC = g.H * g.W * g.C;
  const Tensor wf = filter_f32(w, ws);
  ChunkView DYv(dy, PQ * g.K, cp, ws, ChunkView::in), DXv(dx, HWC, cp, ws, ChunkView::out);
  CMapR W(wf.data<float>(), g.K, RSC);
  for_chunks(cp.nchunks, cp.threads, [&](int64_t c, int t) {
    const int64_t n0 = c * chunk, nb = std::min(chunk, g.N - n0);
    CMapR DY(DYv.get(n0, nb, t), nb * PQ, g.K);
    float* out = DXv.get(n0, nb, t);
    if (cp.pointwise) {
      MapR(out, nb * PQ, g.C).noalias() = DY * W;
    } else {
      std::memset(out, 0, static_cast<size_t>(nb * HWC) * sizeof(float));
      MapR(cp.col(t), nb * PQ, RSC).noalias() = DY * W;
      col2im(cp.col(t), out, g, nb);
    }
    DXv.put(n0, nb, t);
  });
}

void CpuBackend::conv2d_backward_filter(const Tensor& x, const Tensor& dy, const Tensor& dw,
                                        const ConvGeom& g, MemoryPool& ws) {
  // The weight gradient accumulates (+=): a 16-bit one (no model keeps one) takes the
  // whole-tensor path; activations are read a chunk at a time.
  if (dw.dtype() != DType::f32) {
    run_in_f32({In(x), In(dy), InOut(dw)}, [&](auto& t) { conv2d_backward_filter(t[0], t[1], t[2], g, ws); });
    return;
  }
  apply_thread_default();
  check_conv(x, dw, dy, g, "conv2d_backward_filter");
  if (g.groups > 1) return grouped::backward_filter(x, dy, dw, g, ws);
  if (const int m = kHasDirect ? direct::winograd_tile(g) : 0) return winograd_backward_filter(x, dy, dw, m, g, ws);
  if (kHasDirect && direct::serves_backward_filter(g)) return direct_backward_filter(x, dy, dw, g, ws);
  const ChunkPlan cp(g, ws);
  const int64_t RSC = cp.RSC, PQ = cp.PQ, chunk = cp.chunk;
  const int T = cp.threads;
  ChunkView X(x, g.H * g.W * g.C, cp, ws, ChunkView::in), DYv(dy, PQ * g.K, cp, ws, ChunkView::in);
  // With several threads, one partial dW each, summed in thread order at the end (deterministic
  // for a given thread count).
  std::vector<std::unique_ptr<Workspace>> partial;
  for (int t = 0; t < (T > 1 ? T : 0); ++t) {
    partial.push_back(std::make_unique<Workspace>(ws, static_cast<size_t>(g.K * RSC) * sizeof(float)));
    std::memset(partial.back()->p, 0, static_cast<size_t>(g.K * RSC) * sizeof(float));
  }
  for_chunks(cp.nchunks, T, [&](int64_t c, int t) {
    const int64_t n0 = c * chunk, nb = std::min(chunk, g.N - n0);
    const float* a = X.get(n0, nb, t);
    if (!cp.pointwise) {
      im2col(a, cp.col(t), g, nb);
      a = cp.col(t);
    }
    MapR DW(T > 1 ? partial[t]->p : dw.data<float>(), g.K, RSC);
    DW.noalias() += CMapR(DYv.get(n0, nb, t), nb * PQ, g.K).transpose() * CMapR(a, nb * PQ, RSC);
  });
  if (T > 1) {
    MapR DW(dw.data<float>(), g.K, RSC);
    for (int t = 0; t < T; ++t) DW += MapR(partial[t]->p, g.K, RSC);
  }
}

}  // namespace replica::ops::REPLICA_CPU_ISA_NS
