// CPU convolution on NHWC via im2col + Eigen GEMM, a batch chunk at a time so the column buffer
// (from the pool, tag workspace) stays cache-sized. 1x1 stride-1 unpadded convolutions skip
// im2col: the input already is the column matrix.
#include <Eigen/Core>
#include <algorithm>
#include <cstring>

#include "core/errors.h"
#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/threads.h"

namespace replica::ops {
namespace {

using MatR = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MapR = Eigen::Map<MatR>;
using CMapR = Eigen::Map<const MatR>;

// 1 MiB of columns per chunk keeps the packed GEMM operands in L2: measured 1.25x faster than
// 4 MiB on ResNet-20 (bench/RESULTS.md).
constexpr size_t kColBytes = size_t(1) << 20;

bool is_pointwise(const ConvGeom& g) { return g.R == 1 && g.S == 1 && g.stride == 1 && g.pad == 0; }

int64_t chunk_images(const ConvGeom& g) {
  size_t per_image = static_cast<size_t>(g.P * g.Q * g.R * g.S * g.C) * sizeof(float);
  return std::clamp<int64_t>(static_cast<int64_t>(kColBytes / std::max<size_t>(per_image, 1)), 1, g.N);
}

// Rows are output pixels (n,p,q); columns are (r,s,c), matching KRSC filters.
void im2col(const float* x, float* col, const ConvGeom& g, int64_t n0, int64_t nb) {
  const int64_t SC = g.S * g.C, RSC = g.R * SC;
  for (int64_t n = 0; n < nb; ++n) {
    const float* img = x + (n0 + n) * g.H * g.W * g.C;
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

// Adds the column matrix back into dx (which the caller zeroed).
void col2im(const float* col, float* dx, const ConvGeom& g, int64_t n0, int64_t nb) {
  const int64_t SC = g.S * g.C, RSC = g.R * SC;
  for (int64_t n = 0; n < nb; ++n) {
    float* img = dx + (n0 + n) * g.H * g.W * g.C;
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
  if (x.dtype() != DType::f32 || w.dtype() != DType::f32 || y.dtype() != DType::f32)
    throw ShapeError(std::string(who) + ": the CPU kernel computes in f32; cast 16-bit tensors first");
  if (x.numel() != g.N * g.H * g.W * g.C || w.numel() != g.K * g.R * g.S * g.C ||
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

}  // namespace

void CpuBackend::conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& y, const ConvGeom& g,
                                MemoryPool& ws) {
  apply_thread_default();
  check_conv(x, w, y, g, "conv2d_forward");
  const int64_t RSC = g.R * g.S * g.C, PQ = g.P * g.Q;
  CMapR W(w.data<float>(), g.K, RSC);
  if (is_pointwise(g)) {
    MapR Y(y.data<float>(), g.N * PQ, g.K);
    Y.noalias() = CMapR(x.data<float>(), g.N * PQ, g.C) * W.transpose();
    return;
  }
  const int64_t chunk = chunk_images(g);
  Workspace col(ws, static_cast<size_t>(chunk * PQ * RSC) * sizeof(float));
  for (int64_t n0 = 0; n0 < g.N; n0 += chunk) {
    const int64_t nb = std::min(chunk, g.N - n0);
    im2col(x.data<float>(), col.p, g, n0, nb);
    MapR Y(y.data<float>() + n0 * PQ * g.K, nb * PQ, g.K);
    Y.noalias() = CMapR(col.p, nb * PQ, RSC) * W.transpose();
  }
}

void CpuBackend::conv2d_backward_data(const Tensor& dy, const Tensor& w, const Tensor& dx,
                                      const ConvGeom& g, MemoryPool& ws) {
  apply_thread_default();
  check_conv(dx, w, dy, g, "conv2d_backward_data");
  const int64_t RSC = g.R * g.S * g.C, PQ = g.P * g.Q;
  CMapR W(w.data<float>(), g.K, RSC);
  if (is_pointwise(g)) {
    MapR DX(dx.data<float>(), g.N * PQ, g.C);
    DX.noalias() = CMapR(dy.data<float>(), g.N * PQ, g.K) * W;
    return;
  }
  std::memset(dx.raw(), 0, dx.nbytes());
  const int64_t chunk = chunk_images(g);
  Workspace col(ws, static_cast<size_t>(chunk * PQ * RSC) * sizeof(float));
  for (int64_t n0 = 0; n0 < g.N; n0 += chunk) {
    const int64_t nb = std::min(chunk, g.N - n0);
    MapR COL(col.p, nb * PQ, RSC);
    COL.noalias() = CMapR(dy.data<float>() + n0 * PQ * g.K, nb * PQ, g.K) * W;
    col2im(col.p, dx.data<float>(), g, n0, nb);
  }
}

void CpuBackend::conv2d_backward_filter(const Tensor& x, const Tensor& dy, const Tensor& dw,
                                        const ConvGeom& g, MemoryPool& ws) {
  apply_thread_default();
  check_conv(x, dw, dy, g, "conv2d_backward_filter");
  const int64_t RSC = g.R * g.S * g.C, PQ = g.P * g.Q;
  MapR DW(dw.data<float>(), g.K, RSC);
  if (is_pointwise(g)) {
    DW.noalias() += CMapR(dy.data<float>(), g.N * PQ, g.K).transpose() *
                    CMapR(x.data<float>(), g.N * PQ, g.C);
    return;
  }
  const int64_t chunk = chunk_images(g);
  Workspace col(ws, static_cast<size_t>(chunk * PQ * RSC) * sizeof(float));
  for (int64_t n0 = 0; n0 < g.N; n0 += chunk) {
    const int64_t nb = std::min(chunk, g.N - n0);
    im2col(x.data<float>(), col.p, g, n0, nb);
    DW.noalias() += CMapR(dy.data<float>() + n0 * PQ * g.K, nb * PQ, g.K).transpose() *
                    CMapR(col.p, nb * PQ, RSC);
  }
}

}  // namespace replica::ops
