// CPU kernels other than convolution and the loss (loss_kernels.cpp): batch norm, elementwise,
// pooling, linear, cast, reductions.
// Per-channel reductions accumulate in double so gradient checks and replica equivalence are not
// at the mercy of float summation order.
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "core/errors.h"
#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/mixed.h"
#include "ops/cpu/parallel_for.h"
#include "ops/cpu/threads.h"

namespace replica::ops::REPLICA_CPU_ISA_NS {
namespace {

using MatR = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MapR = Eigen::Map<MatR>;
using CMapR = Eigen::Map<const MatR>;

void require_same(const Tensor& a, const Tensor& b, const char* who) {
  if (a.numel() != b.numel())
    throw ShapeError(std::string(who) + ": " + a.str() + " and " + b.str() + " differ in size");
}

// Sums `buf` across replicas when a reduction is given; doubles travel as floats.
void reduce(std::vector<double>& buf, const AllReduceFn& allreduce) {
  if (!allreduce) return;
  std::vector<float> f(buf.begin(), buf.end());
  allreduce(f.data(), f.size());
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = f[i];
}

// Conversion buffers for Rows, kept by the thread that runs the op and reused by its next ops:
// a fresh vector per call faulted its pages in and zeroed them every time, ~1 ms a call at
// 7x7x2048 (the 16-bit batch norm then ran at 5% of the copy rate; bench/RESULTS.md). Rows are
// made and dropped in nesting order, so the buffers are a stack: one per live Rows.
class RowBuffers {
 public:
  static float* take(size_t floats) {
    Stack& s = stack();
    if (s.depth == s.bufs.size()) s.bufs.emplace_back();
    Buf& b = s.bufs[s.depth++];
    if (b.size < floats) {
      b.data.reset(new float[floats]);  // not zeroed: every element is written before it is read
      b.size = floats;
    }
    return b.data.get();
  }
  static void give_back() { --stack().depth; }

 private:
  struct Buf {
    std::unique_ptr<float[]> data;
    size_t size = 0;
  };
  struct Stack {
    std::vector<Buf> bufs;
    size_t depth = 0;
  };
  static Stack& stack() {
    thread_local Stack s;
    return s;
  }
};

// Rows of an [M, C] activation in f32, kBlock at a time: f32 tensors in place; 16-bit ones
// converted block by block into a small buffer (it stays in cache) and, for outputs, rounded
// back by put(). run_in_f32's arithmetic exactly, without its whole-tensor f32 copies.
class Rows {
 public:
  static constexpr int64_t kBlock = 32;
  // threads: one conversion buffer per intra-op thread (parallel_for's thread index).
  Rows(const Tensor& t, int64_t C, int threads = 1) : t_(t), C_(C), stride_(kBlock * C) {
    if (t.dtype() != DType::f32) bufs_ = RowBuffers::take(static_cast<size_t>(threads * stride_));
  }
  ~Rows() {
    if (bufs_) RowBuffers::give_back();
  }
  Rows(const Rows&) = delete;
  Rows& operator=(const Rows&) = delete;
  // Rows [i0, i0 + n) to read.
  const float* in(int64_t i0, int64_t n, int thread = 0) {
    if (!bufs_) return t_.data<float>() + i0 * C_;
    float* b = buf(thread);
    convert(at(i0), t_.dtype(), b, DType::f32, static_cast<size_t>(n * C_));
    return b;
  }
  // Rows from i0 to write, then put(i0, n).
  float* out(int64_t i0, int thread = 0) { return bufs_ ? buf(thread) : t_.data<float>() + i0 * C_; }
  void put(int64_t i0, int64_t n, int thread = 0) {
    if (bufs_) convert(buf(thread), DType::f32, at(i0), t_.dtype(), static_cast<size_t>(n * C_));
  }

 private:
  float* buf(int thread) const { return bufs_ + thread * stride_; }
  char* at(int64_t i0) const { return static_cast<char*>(t_.raw()) + static_cast<size_t>(i0 * C_) * dtype_size(t_.dtype()); }
  const Tensor& t_;
  int64_t C_, stride_;
  float* bufs_ = nullptr;  // threads x stride_ floats from RowBuffers, when t is 16-bit
};

// The row blocks of an [M, C] pass, and the threads that share them: more than one only when
// the replica has intra-op threads and the pass has enough blocks to be worth a fork.
struct RowBlocks {
  explicit RowBlocks(int64_t M)
      : M(M), count((M + Rows::kBlock - 1) / Rows::kBlock), threads(count >= 64 ? intra_op_threads() : 1) {}
  int64_t first(int64_t b) const { return b * Rows::kBlock; }
  int64_t rows(int64_t b) const { return std::min(Rows::kBlock, M - b * Rows::kBlock); }
  const int64_t M, count;
  const int threads;
};

// A per-channel parameter (gamma, beta: small) in f32.
std::vector<float> channel_f32(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  convert(t.raw(), t.dtype(), v.data(), DType::f32, v.size());
  return v;
}

int64_t channels_of(const Tensor& x, const char* who) {
  if (x.dtype() != DType::f32 && x.dtype() != DType::f16 && x.dtype() != DType::bf16)
    throw ShapeError(std::string(who) + ": expected f32, f16 or bf16, got " + x.str());
  return x.shape()[x.shape().rank() - 1];
}

// Per-block sums over the rows of an [M, C] matrix: f32 partial sums over blocks of
// Rows::kBlock rows (they vectorise across C), folded into double in block order so long
// reductions keep their precision. block(i0, n, part, thread) adds rows [i0, i0 + n) into part
// (width floats, acc[acc_offset ..] receives them). Every block keeps its own partial, so with
// intra-op threads the blocks run in parallel and the fold is still in block order: the same
// bits for any thread count.
template <typename BlockFn>
void block_sums(const RowBlocks& rb, int64_t width, std::vector<double>& acc, int64_t acc_offset, BlockFn&& block) {
  // The calling thread's scratch, reused (a fresh vector per call would fault its pages in
  // again). Named through a plain pointer: inside the parallel loop `scratch` would be each
  // worker's own thread_local, not this one.
  thread_local std::vector<float> scratch;
  scratch.assign(static_cast<size_t>(rb.count * width), 0.f);
  float* parts = scratch.data();
  parallel_for(rb.count, rb.threads, [&](int64_t b, int t) { block(rb.first(b), rb.rows(b), parts + b * width, t); });
  for (int64_t b = 0; b < rb.count; ++b)
    for (int64_t c = 0; c < width; ++c) acc[acc_offset + c] += parts[b * width + c];
}

// A fused ReLU's mask applied to rows [i0, i0 + n) of dy in place (pdy: those rows as read),
// inside a backward pass's first sweep rather than a pass of its own; returns the masked rows,
// which the caller's later passes read back from dy.
const float* mask_rows(Rows& DY, Rows& RY, const float* pdy, int64_t i0, int64_t n, int64_t C, int t) {
  const float* py = RY.in(i0, n, t);
  float* m = DY.out(i0, t);
  for (int64_t i = 0; i < n * C; ++i) m[i] = py[i] > 0.f ? pdy[i] : 0.f;
  DY.put(i0, n, t);
  return m;
}

// y = x * a[c] + b[c], plus the residual's element when given (R: a residual block's join), then
// max(., 0) when a ReLU is fused (NaN stays NaN, as relu_forward). In f32 the bits equal the
// unfused ops' (the affine map rounded to f32, then the add, then the ReLU); 16-bit storage rounds
// once instead of twice.
void apply_affine(Rows& X, Rows& Y, Rows* R, const RowBlocks& rb, int64_t C, const float* a, const float* b,
                  bool relu) {
  parallel_for(rb.count, rb.threads, [&](int64_t blk, int t) {
    const int64_t i0 = rb.first(blk), n = rb.rows(blk);
    const float* px = X.in(i0, n, t);
    const float* pr = R ? R->in(i0, n, t) : nullptr;
    float* py = Y.out(i0, t);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < C; ++c) {
        float v = px[i * C + c] * a[c] + b[c];
        if (pr) v += pr[i * C + c];
        py[i * C + c] = relu && v < 0.f ? 0.f : v;
      }
    Y.put(i0, n, t);
  });
}

}  // namespace

void CpuBackend::batchnorm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                         const Tensor& y, const Tensor& save_mean,
                                         const Tensor& save_invstd, const Tensor& running_mean,
                                         const Tensor& running_var, float momentum, float eps,
                                         const AllReduceFn& allreduce, const Tensor& residual, bool relu) {
  const int64_t C = channels_of(x, "batchnorm_forward_train"), M = x.numel() / C;
  require_same(x, y, "batchnorm_forward_train");
  if (residual.defined()) require_same(x, residual, "batchnorm_forward_train (residual)");
  apply_thread_default();
  const RowBlocks rb(M);
  Rows X(x, C, rb.threads), Y(y, C, rb.threads), R(residual.defined() ? residual : x, C, rb.threads);
  std::vector<double> acc(C + 1, 0.0);
  block_sums(rb, C, acc, 0, [&](int64_t i0, int64_t n, float* part, int t) {
    const float* r = X.in(i0, n, t);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < C; ++c) part[c] += r[i * C + c];
  });
  acc[C] = static_cast<double>(M);
  reduce(acc, allreduce);
  const double Mg = acc[C];
  std::vector<double> mean(C), sq(C, 0.0);
  std::vector<float> meanf(C);
  for (int64_t c = 0; c < C; ++c) meanf[c] = static_cast<float>(mean[c] = acc[c] / Mg);
  block_sums(rb, C, sq, 0, [&](int64_t i0, int64_t n, float* part, int t) {
    const float* r = X.in(i0, n, t);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < C; ++c) {
        float d = r[i * C + c] - meanf[c];
        part[c] += d * d;
      }
  });
  reduce(sq, allreduce);
  float* sm = save_mean.data<float>();
  float* si = save_invstd.data<float>();
  float* rm = running_mean.data<float>();
  float* rv = running_var.data<float>();
  const std::vector<float> g = channel_f32(gamma), be = channel_f32(beta);
  std::vector<float> a(C), b(C);
  for (int64_t c = 0; c < C; ++c) {
    double var = sq[c] / Mg;
    double inv = 1.0 / std::sqrt(var + eps);
    sm[c] = static_cast<float>(mean[c]);
    si[c] = static_cast<float>(inv);
    a[c] = static_cast<float>(g[c] * inv);
    b[c] = static_cast<float>(be[c] - mean[c] * g[c] * inv);
    double unbiased = Mg > 1 ? var * Mg / (Mg - 1) : var;
    rm[c] = static_cast<float>((1 - momentum) * rm[c] + momentum * mean[c]);
    rv[c] = static_cast<float>((1 - momentum) * rv[c] + momentum * unbiased);
  }
  apply_affine(X, Y, residual.defined() ? &R : nullptr, rb, C, a.data(), b.data(), relu);
}

void CpuBackend::batchnorm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                        const Tensor& y, const Tensor& running_mean,
                                        const Tensor& running_var, float eps, const Tensor& residual, bool relu) {
  const int64_t C = channels_of(x, "batchnorm_forward_eval"), M = x.numel() / C;
  require_same(x, y, "batchnorm_forward_eval");
  if (residual.defined()) require_same(x, residual, "batchnorm_forward_eval (residual)");
  const std::vector<float> g = channel_f32(gamma), be = channel_f32(beta);
  std::vector<float> a(C), b(C);
  for (int64_t c = 0; c < C; ++c) {
    float inv = 1.0f / std::sqrt(running_var.data<float>()[c] + eps);
    a[c] = g[c] * inv;
    b[c] = be[c] - running_mean.data<float>()[c] * a[c];
  }
  apply_thread_default();
  const RowBlocks rb(M);
  Rows X(x, C, rb.threads), Y(y, C, rb.threads), R(residual.defined() ? residual : x, C, rb.threads);
  apply_affine(X, Y, residual.defined() ? &R : nullptr, rb, C, a.data(), b.data(), relu);
}

void CpuBackend::batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                    const Tensor& save_mean, const Tensor& save_invstd,
                                    const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta,
                                    const AllReduceFn& allreduce, const Tensor& relu_y) {
  const int64_t C = channels_of(x, "batchnorm_backward"), M = x.numel() / C;
  require_same(x, dy, "batchnorm_backward");
  require_same(x, dx, "batchnorm_backward");
  const bool relu = relu_y.defined();
  if (relu) require_same(x, relu_y, "batchnorm_backward");
  apply_thread_default();
  const RowBlocks rb(M);
  Rows X(x, C, rb.threads), DY(dy, C, rb.threads), DX(dx, C, rb.threads), RY(relu ? relu_y : x, C, rb.threads);
  const float* mean = save_mean.data<float>();
  const float* inv = save_invstd.data<float>();
  std::vector<double> acc(2 * C + 1, 0.0);  // sum dy, sum dy*xhat, count
  // One pass over x and dy for both sums (part: C floats of each, per block of rows).
  block_sums(rb, 2 * C, acc, 0, [&](int64_t i0, int64_t n, float* part, int t) {
    const float* pdy = DY.in(i0, n, t);
    const float* px = X.in(i0, n, t);
    if (relu) pdy = mask_rows(DY, RY, pdy, i0, n, C, t);
    float* p1 = part;
    float* p2 = part + C;
    for (int64_t i = 0; i < n; ++i) {
      const float* g = pdy + i * C;
      const float* r = px + i * C;
      for (int64_t c = 0; c < C; ++c) {
        p1[c] += g[c];
        p2[c] += g[c] * (r[c] - mean[c]) * inv[c];
      }
    }
  });
  for (int64_t c = 0; c < C; ++c) {
    dbeta.data<float>()[c] += static_cast<float>(acc[c]);
    dgamma.data<float>()[c] += static_cast<float>(acc[C + c]);
  }
  acc[2 * C] = static_cast<double>(M);
  reduce(acc, allreduce);  // sync-BN: dx needs the sums over the global batch
  const double Mg = acc[2 * C];
  const std::vector<float> gm = channel_f32(gamma);
  std::vector<float> k(C), m1(C), m2(C);
  for (int64_t c = 0; c < C; ++c) {
    k[c] = gm[c] * inv[c];
    m1[c] = static_cast<float>(acc[c] / Mg);
    m2[c] = static_cast<float>(acc[C + c] / Mg);
  }
  parallel_for(rb.count, rb.threads, [&](int64_t blk, int t) {
    const int64_t i0 = rb.first(blk), n = rb.rows(blk);
    const float* pdy = DY.in(i0, n, t);
    const float* px = X.in(i0, n, t);
    float* pdx = DX.out(i0, t);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < C; ++c) {
        float xhat = (px[i * C + c] - mean[c]) * inv[c];
        pdx[i * C + c] = k[c] * (pdy[i * C + c] - m1[c] - xhat * m2[c]);
      }
    DX.put(i0, n, t);
  });
}

void CpuBackend::batchnorm_backward_frozen(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                           const Tensor& mean, const Tensor& invstd, const Tensor& dx,
                                           const Tensor& dgamma, const Tensor& dbeta, const Tensor& relu_y) {
  const int64_t C = channels_of(x, "batchnorm_backward_frozen"), M = x.numel() / C;
  require_same(x, dy, "batchnorm_backward_frozen");
  require_same(x, dx, "batchnorm_backward_frozen");
  const bool relu = relu_y.defined();
  if (relu) require_same(x, relu_y, "batchnorm_backward_frozen");
  apply_thread_default();
  const RowBlocks rb(M);
  Rows X(x, C, rb.threads), DY(dy, C, rb.threads), DX(dx, C, rb.threads), RY(relu ? relu_y : x, C, rb.threads);
  const float* mu = mean.data<float>();
  const float* inv = invstd.data<float>();
  std::vector<double> acc(2 * C, 0.0);
  block_sums(rb, C, acc, 0, [&](int64_t i0, int64_t n, float* part, int t) {
    const float* pdy = DY.in(i0, n, t);
    if (relu) pdy = mask_rows(DY, RY, pdy, i0, n, C, t);  // the later passes read the masked dy
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < C; ++c) part[c] += pdy[i * C + c];
  });
  block_sums(rb, C, acc, C, [&](int64_t i0, int64_t n, float* part, int t) {
    const float* pdy = DY.in(i0, n, t);
    const float* px = X.in(i0, n, t);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < C; ++c) part[c] += pdy[i * C + c] * (px[i * C + c] - mu[c]) * inv[c];
  });
  const std::vector<float> gm = channel_f32(gamma);
  std::vector<float> k(C);
  for (int64_t c = 0; c < C; ++c) {
    dbeta.data<float>()[c] += static_cast<float>(acc[c]);
    dgamma.data<float>()[c] += static_cast<float>(acc[C + c]);
    k[c] = gm[c] * inv[c];
  }
  parallel_for(rb.count, rb.threads, [&](int64_t blk, int t) {
    const int64_t i0 = rb.first(blk), n = rb.rows(blk);
    const float* pdy = DY.in(i0, n, t);
    float* pdx = DX.out(i0, t);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < C; ++c) pdx[i * C + c] = k[c] * pdy[i * C + c];
    DX.put(i0, n, t);
  });
}

void CpuBackend::relu_forward(const Tensor& x, const Tensor& y) {
  require_same(x, y, "relu_forward");
  // NaN stays NaN (as in PyTorch), so a poisoned input cannot hide behind a ReLU
  elementwise_in_f32({In(x), Out(y)}, [](float* const* p, int64_t n) {
    for (int64_t i = 0; i < n; ++i) p[1][i] = p[0][i] < 0.f ? 0.f : p[0][i];
  });
}

void CpuBackend::relu_backward(const Tensor& y, const Tensor& dy, const Tensor& dx) {
  require_same(y, dy, "relu_backward");
  require_same(y, dx, "relu_backward");
  elementwise_in_f32({In(y), In(dy), Out(dx)}, [](float* const* p, int64_t n) {
    for (int64_t i = 0; i < n; ++i) p[2][i] = p[0][i] > 0.f ? p[1][i] : 0.f;
  });
}

void CpuBackend::add(const Tensor& a, const Tensor& b, const Tensor& y) {
  require_same(a, b, "add");
  require_same(a, y, "add");
  elementwise_in_f32({In(a), In(b), Out(y)}, [](float* const* p, int64_t n) {
    for (int64_t i = 0; i < n; ++i) p[2][i] = p[0][i] + p[1][i];
  });
}

void CpuBackend::add_relu(const Tensor& a, const Tensor& b, const Tensor& y) {
  require_same(a, b, "add_relu");
  require_same(a, y, "add_relu");
  elementwise_in_f32({In(a), In(b), Out(y)}, [](float* const* p, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      const float v = p[0][i] + p[1][i];
      p[2][i] = v < 0.f ? 0.f : v;
    }
  });
}

void CpuBackend::axpy(float alpha, const Tensor& x, const Tensor& y) {
  require_same(x, y, "axpy");
  elementwise_in_f32({In(x), InOut(y)}, [alpha](float* const* p, int64_t n) {
    for (int64_t i = 0; i < n; ++i) p[1][i] += alpha * p[0][i];
  });
}

void CpuBackend::set_values(const Tensor& dst, const float* values, int64_t n) {
  if (dst.dtype() != DType::f32 || n < 0 || n > kMaxSetValues || dst.numel() < n)
    throw ShapeError("set_values: " + std::to_string(n) + " values do not fit " + dst.str() + " (f32, at most " +
                     std::to_string(kMaxSetValues) + ")");
  std::memcpy(dst.data<float>(), values, static_cast<size_t>(n) * sizeof(float));
}

void CpuBackend::fill(const Tensor& y, float value) {
  if (y.dtype() == DType::f32) {
    std::fill_n(y.data<float>(), y.numel(), value);
    return;
  }
  for (int64_t i = 0; i < y.numel(); ++i) convert(&value, DType::f32, static_cast<char*>(y.raw()) + i * dtype_size(y.dtype()), y.dtype(), 1);
}

void CpuBackend::scale(const Tensor& y, float alpha) {
  elementwise_in_f32({InOut(y)}, [alpha](float* const* p, int64_t n) {
    for (int64_t i = 0; i < n; ++i) p[0][i] *= alpha;
  });
}

void CpuBackend::scale_by(const Tensor& y, const Tensor& factor) {
  check_factor(factor, y, "scale_by");
  scale(y, factor.data<float>()[0]);
}

void CpuBackend::maxpool_forward(const Tensor& x, const Tensor& y, const Tensor& argmax,
                                 const PoolGeom& g) {
  if (run_in_f32({In(x), Out(y)}, [&](auto& t) { maxpool_forward(t[0], t[1], argmax, g); })) return;
  const float* px = x.data<float>();
  float* py = y.data<float>();
  int32_t* pa = argmax.data<int32_t>();
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t p = 0; p < g.P; ++p)
      for (int64_t q = 0; q < g.Q; ++q) {
        float* out = py + ((n * g.P + p) * g.Q + q) * g.C;
        int32_t* arg = pa + ((n * g.P + p) * g.Q + q) * g.C;
        for (int64_t c = 0; c < g.C; ++c) {
          out[c] = -std::numeric_limits<float>::infinity();
          arg[c] = -1;
        }
        for (int64_t r = 0; r < g.window; ++r) {
          int64_t h = p * g.stride - g.pad + r;
          if (h < 0 || h >= g.H) continue;
          for (int64_t s = 0; s < g.window; ++s) {
            int64_t w = q * g.stride - g.pad + s;
            if (w < 0 || w >= g.W) continue;
            const float* in = px + ((n * g.H + h) * g.W + w) * g.C;
            for (int64_t c = 0; c < g.C; ++c)
              if (in[c] > out[c] || arg[c] < 0) {
                out[c] = in[c];
                arg[c] = static_cast<int32_t>(h * g.W + w);
              }
          }
        }
      }
}

void CpuBackend::maxpool_backward(const Tensor& dy, const Tensor& argmax, const Tensor& dx,
                                  const PoolGeom& g) {
  if (run_in_f32({In(dy), Out(dx)}, [&](auto& t) { maxpool_backward(t[0], argmax, t[1], g); }))
    return;
  std::memset(dx.raw(), 0, dx.nbytes());
  const float* pdy = dy.data<float>();
  const int32_t* pa = argmax.data<int32_t>();
  float* pdx = dx.data<float>();
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t pq = 0; pq < g.P * g.Q; ++pq)
      for (int64_t c = 0; c < g.C; ++c) {
        int64_t i = (n * g.P * g.Q + pq) * g.C + c;
        pdx[(n * g.H * g.W + pa[i]) * g.C + c] += pdy[i];
      }
}

void CpuBackend::global_avgpool_forward(const Tensor& x, const Tensor& y) {
  if (run_in_f32({In(x), Out(y)}, [&](auto& t) { global_avgpool_forward(t[0], t[1]); })) return;
  const int64_t N = x.dim(0), HW = x.dim(1) * x.dim(2), C = x.dim(3);
  const float* px = x.data<float>();
  float* py = y.data<float>();
  std::vector<double> acc(C);
  for (int64_t n = 0; n < N; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t i = 0; i < HW; ++i)
      for (int64_t c = 0; c < C; ++c) acc[c] += px[(n * HW + i) * C + c];
    for (int64_t c = 0; c < C; ++c) py[n * C + c] = static_cast<float>(acc[c] / HW);
  }
}

void CpuBackend::global_avgpool_backward(const Tensor& dy, const Tensor& dx) {
  if (run_in_f32({In(dy), Out(dx)}, [&](auto& t) { global_avgpool_backward(t[0], t[1]); })) return;
  const int64_t N = dx.dim(0), HW = dx.dim(1) * dx.dim(2), C = dx.dim(3);
  const float* pdy = dy.data<float>();
  float* pdx = dx.data<float>();
  const float inv = 1.0f / static_cast<float>(HW);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < HW; ++i)
      for (int64_t c = 0; c < C; ++c) pdx[(n * HW + i) * C + c] = pdy[n * C + c] * inv;
}

void CpuBackend::linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y) {
  if (run_in_f32({In(x), In(w), In(b), Out(y)},
                 [&](auto& t) { linear_forward(t[0], t[1], t[2], t[3]); }))
    return;
  apply_thread_default();
  const int64_t N = x.dim(0), I = x.numel() / N, O = w.dim(0);
  if (w.numel() != O * I)
    throw ShapeError("linear_forward: input " + x.str() + " has " + std::to_string(I) +
                     " features but the weight is " + w.str());
  MapR Y(y.data<float>(), N, O);
  Y.noalias() = CMapR(x.data<float>(), N, I) * CMapR(w.data<float>(), O, I).transpose();
  Y.rowwise() += Eigen::Map<const Eigen::RowVectorXf>(b.data<float>(), O);
}

void CpuBackend::linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy,
                                 const Tensor& dx, const Tensor& dw, const Tensor& db) {
  if (run_in_f32({In(x), In(w), In(dy), Out(dx)},
                 [&](auto& t) { linear_backward(t[0], t[1], t[2], t[3], dw, db); }))
    return;
  apply_thread_default();
  const int64_t N = x.dim(0), I = x.numel() / N, O = w.dim(0);
  CMapR DY(dy.data<float>(), N, O);
  if (dx.defined()) MapR(dx.data<float>(), N, I).noalias() = DY * CMapR(w.data<float>(), O, I);
  MapR(dw.data<float>(), O, I).noalias() += DY.transpose() * CMapR(x.data<float>(), N, I);
  Eigen::Map<Eigen::RowVectorXf>(db.data<float>(), O) += DY.colwise().sum();
}

void CpuBackend::cast(const Tensor& src, const Tensor& dst) {
  require_same(src, dst, "cast");
  convert(src.raw(), src.dtype(), dst.raw(), dst.dtype(), static_cast<size_t>(src.numel()));
}

double CpuBackend::sum_squares(const Tensor& x) {
  note_host_sync();
  return sum_sq(x);
}

void CpuBackend::sum_squares_into(const Tensor& x, const Tensor& out) {
  out.data<float>()[0] = static_cast<float>(sum_sq(x));
}

void CpuBackend::read_to_host(const Tensor& src, void* dst, const std::function<void()>&) {
  note_host_sync();
  std::memcpy(dst, src.raw(), src.nbytes());
}

double CpuBackend::sum_sq(const Tensor& x) {
  const float* p = x.data<float>();
  double s = 0;
  for (int64_t i = 0, n = x.numel(); i < n; ++i) s += static_cast<double>(p[i]) * p[i];
  return s;
}

bool CpuBackend::unscale_check_finite(const Tensor& grads, float inv_scale) {
  note_host_sync();
  return unscale_check(grads, inv_scale);
}

void CpuBackend::unscale_check_finite_into(const Tensor& grads, const StepScalar& inv_scale, const Tensor& nonfinite) {
  check_step_scalar(inv_scale, grads, "unscale_check_finite_into");
  if (!unscale_check(grads, host_value(inv_scale))) nonfinite.data<float>()[0] = 1.f;
}

bool CpuBackend::unscale_check(const Tensor& grads, float inv_scale) {
  float* p = grads.data<float>();
  // Branch-free: x - x is 0 for finite x and NaN for inf/NaN, so the sum stays 0 only if all
  // are finite (and the loop vectorises).
  float probe = 0.f;
  for (int64_t i = 0, n = grads.numel(); i < n; ++i) {
    probe += p[i] - p[i];
    p[i] *= inv_scale;
  }
  return probe == 0.f;
}

Backend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

CpuIsa cpu_backend_isa() { return kIsa; }

}  // namespace replica::ops::REPLICA_CPU_ISA_NS
