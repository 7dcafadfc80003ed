// Elementwise kernels of the op backend: casts, ReLU and its gradient, add (and add + ReLU),
// axpy, fill, scale, the step's values, and the linear layer's bias broadcast and gradient. Each
// has a scalar form over (pointer, dtype) pairs and, where every pointer is 16-byte aligned, the
// 8-element vector form k_map8 (kernel_common.cuh's load8/store8).
#include "ops/cuda/kernel_common.cuh"

namespace replica::ops::cuk {
namespace {

// The elementwise operations, each on up to two inputs a, b (an unused one reads 0).
struct ReluOp {
  __device__ float operator()(float a, float) const { return a < 0.f ? 0.f : a; }  // NaN stays NaN
};
struct ReluBwdOp {  // a = the ReLU's output y, b = dy
  __device__ float operator()(float a, float b) const { return a > 0.f ? b : 0.f; }
};
struct AddOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct AddReluOp {
  __device__ float operator()(float a, float b) const {
    const float v = a + b;
    return v < 0.f ? 0.f : v;
  }
};
struct AxpyOp {  // a = y, b = x: y + alpha x
  float alpha;
  __device__ float operator()(float a, float b) const { return a + alpha * b; }
};
struct ScaleOp {
  float alpha;
  __device__ float operator()(float a, float) const { return a * alpha; }
};
struct CopyOp {  // a cast: the conversion is in the load and the store
  __device__ float operator()(float a, float) const { return a; }
};

// y[i] = op(a[i], b[i]) for i < n (b may be null), 8 elements per thread and round; the n % 8
// left over by block 0. In place (y == a or y == b) is safe: a thread loads its elements before
// it stores them.
template <typename TA, typename TB, typename TY, typename Op>
__global__ void k_map8(const TA* a, const TB* b, TY* y, int64_t n, Op op) {
  const int64_t nv = n / kVec;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < nv;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float x[kVec], z[kVec] = {};
    load8(a + v * kVec, x);
    if (b) load8(b + v * kVec, z);
#pragma unroll
    for (int j = 0; j < kVec; ++j) x[j] = op(x[j], z[j]);
    store8(y + v * kVec, x);
  }
  const int64_t i = nv * kVec + threadIdx.x;
  if (blockIdx.x == 0 && i < n) y[i] = from_float<TY>(op(to_float(a[i]), b ? to_float(b[i]) : 0.f));
}

// ---- elementwise ------------------------------------------------------------------------------

__global__ void k_cast(DPtr src, DPtr dst, int64_t n) {
  unrolled(n, [&](int64_t i) { return ld(src.p, src.dt, i); }, [&](int64_t i, float v) { st(dst.mut(), dst.dt, i, v); });
}
__global__ void k_relu(DPtr x, DPtr y, int64_t n) {
  unrolled(
      n,
      [&](int64_t i) {
        const float v = ld(x.p, x.dt, i);
        return v < 0.f ? 0.f : v;  // NaN stays NaN, as on CPU and in PyTorch
      },
      [&](int64_t i, float v) { st(y.mut(), y.dt, i, v); });
}
__global__ void k_relu_bwd(DPtr y, DPtr dy, DPtr dx, int64_t n) {
  unrolled(n, [&](int64_t i) { return ld(y.p, y.dt, i) > 0.f ? ld(dy.p, dy.dt, i) : 0.f; },
           [&](int64_t i, float v) { st(dx.mut(), dx.dt, i, v); });
}
__global__ void k_add(DPtr a, DPtr b, DPtr y, int64_t n) {
  unrolled(n, [&](int64_t i) { return ld(a.p, a.dt, i) + ld(b.p, b.dt, i); },
           [&](int64_t i, float v) { st(y.mut(), y.dt, i, v); });
}
__global__ void k_add_relu(DPtr a, DPtr b, DPtr y, int64_t n) {
  unrolled(
      n,
      [&](int64_t i) {
        const float v = ld(a.p, a.dt, i) + ld(b.p, b.dt, i);
        return v < 0.f ? 0.f : v;
      },
      [&](int64_t i, float v) { st(y.mut(), y.dt, i, v); });
}
__global__ void k_axpy(float alpha, DPtr x, DPtr y, int64_t n) {
  unrolled(n, [&](int64_t i) { return ld(y.p, y.dt, i) + alpha * ld(x.p, x.dt, i); },
           [&](int64_t i, float v) { st(y.mut(), y.dt, i, v); });
}
// set_values: the values travel in the launch's arguments, copied when the launch is made, so the
// host's buffer is free at once (the step's values are set outside the CUDA graph that reads them:
// a captured launch would keep the values it was captured with).
constexpr int kMaxValues = 64;
struct Values {
  float v[kMaxValues];
};
__global__ void k_set_values(float* y, int n, Values v) {
  if (static_cast<int>(threadIdx.x) < n) y[threadIdx.x] = v.v[threadIdx.x];
}

__global__ void k_fill(DPtr y, float v, int64_t n) {
  GRID_STRIDE(i, n) st(y.mut(), y.dt, i, v);
}
__global__ void k_scale(DPtr y, float alpha, int64_t n) {
  unrolled(n, [&](int64_t i) { return ld(y.p, y.dt, i) * alpha; }, [&](int64_t i, float v) { st(y.mut(), y.dt, i, v); });
}
__global__ void k_rsqrt_eps(const float* x, float* y, float eps, int64_t n) {
  GRID_STRIDE(i, n) y[i] = 1.0f / sqrtf(x[i] + eps);
}

// ---- linear helpers ---------------------------------------------------------------------------

__global__ void k_bias_broadcast(DPtr b, DPtr y, int N, int O) {
  GRID_STRIDE(i, static_cast<int64_t>(N) * O) st(y.mut(), y.dt, i, ld(b.p, b.dt, i % O));
}

__global__ void k_bias_grad(DPtr dy, float* db, int N, int O) {
  GRID_STRIDE(o, O) {
    float s = 0.f;
    for (int n = 0; n < N; ++n) s += ld(dy.p, dy.dt, static_cast<int64_t>(n) * O + o);
    db[o] += s;
  }
}

}  // namespace

// The 16-byte vector form of an elementwise op (k_map8) when a, b (if given) and y are 16-byte
// aligned and a and b share a dtype (y too, unless `cast`); false: the caller runs the scalar one.
// `mixed_b`: b may have another dtype than a and y (the f32 gradient += a 16-bit weight gradient).
template <typename Op>
bool map8(DPtr a, DPtr b, DPtr y, int64_t n, Op op, cudaStream_t s, bool cast = false, bool mixed_b = false) {
  if (n <= 0) return true;
  if (!aligned16(a.p) || (b.p && !aligned16(b.p)) || !aligned16(y.p)) return false;
  if ((b.p && b.dt != a.dt && !mixed_b) || (!cast && y.dt != a.dt)) return false;
  const int grid = grid_for(std::max<int64_t>(1, n / kVec));
  with_type(a.dt, [&](auto ta) {
    using TA = decltype(ta);
    auto launch = [&](auto ty) {
      using TY = decltype(ty);
      k_map8<TA, TA, TY, Op><<<grid, kThreads, 0, s>>>(static_cast<const TA*>(a.p), static_cast<const TA*>(b.p),
                                                       static_cast<TY*>(y.mut()), n, op);
    };
    if (mixed_b && b.p && b.dt != a.dt) {  // y = a's type, b another: the f32 += 16-bit accumulations
      with_type(b.dt, [&](auto tb) {
        using TB = decltype(tb);
        k_map8<TA, TB, TA, Op><<<grid, kThreads, 0, s>>>(static_cast<const TA*>(a.p), static_cast<const TB*>(b.p),
                                                         static_cast<TA*>(y.mut()), n, op);
      });
    } else if (cast) {
      with_type(y.dt, launch);
    } else {
      launch(TA{});
    }
  });
  check_launch("k_map8");
  return true;
}

void cast(DPtr src, DPtr dst, int64_t n, cudaStream_t s) {
  if (!map8(src, DPtr{}, dst, n, CopyOp{}, s, true)) LAUNCH_UNROLLED(k_cast, n, s, src, dst, n);
}
void relu_forward(DPtr x, DPtr y, int64_t n, cudaStream_t s) {
  if (!map8(x, DPtr{}, y, n, ReluOp{}, s)) LAUNCH_UNROLLED(k_relu, n, s, x, y, n);
}
void relu_backward(DPtr y, DPtr dy, DPtr dx, int64_t n, cudaStream_t s) {
  if (!map8(y, dy, dx, n, ReluBwdOp{}, s)) LAUNCH_UNROLLED(k_relu_bwd, n, s, y, dy, dx, n);
}
void add(DPtr a, DPtr b, DPtr y, int64_t n, cudaStream_t s) {
  if (!map8(a, b, y, n, AddOp{}, s)) LAUNCH_UNROLLED(k_add, n, s, a, b, y, n);
}
void add_relu(DPtr a, DPtr b, DPtr y, int64_t n, cudaStream_t s) {
  if (!map8(a, b, y, n, AddReluOp{}, s)) LAUNCH_UNROLLED(k_add_relu, n, s, a, b, y, n);
}
void axpy(float alpha, DPtr x, DPtr y, int64_t n, cudaStream_t s) {
  if (!map8(y, x, y, n, AxpyOp{alpha}, s, false, true)) LAUNCH_UNROLLED(k_axpy, n, s, alpha, x, y, n);
}
void fill(DPtr y, float v, int64_t n, cudaStream_t s) { LAUNCH(k_fill, n, s, y, v, n); }
void set_values(float* y, const float* values, int n, cudaStream_t s) {
  if (n <= 0) return;
  if (n > kMaxValues) throw ShapeError("set_values: " + std::to_string(n) + " values, at most " + std::to_string(kMaxValues));
  Values v{};
  for (int i = 0; i < n; ++i) v.v[i] = values[i];
  k_set_values<<<1, kMaxValues, 0, s>>>(y, n, v);
  check_launch("k_set_values");
}
void scale(DPtr y, float alpha, int64_t n, cudaStream_t s) {
  if (!map8(y, DPtr{}, y, n, ScaleOp{alpha}, s)) LAUNCH_UNROLLED(k_scale, n, s, y, alpha, n);
}
void rsqrt_eps(const float* x, float* y, float eps, int64_t n, cudaStream_t s) { LAUNCH(k_rsqrt_eps, n, s, x, y, eps, n); }

void bias_broadcast(DPtr b, DPtr y, int N, int O, cudaStream_t s) {
  LAUNCH(k_bias_broadcast, static_cast<int64_t>(N) * O, s, b, y, N, O);
}
void bias_grad(DPtr dy, float* db, int N, int O, cudaStream_t s) { LAUNCH(k_bias_grad, O, s, dy, db, N, O); }

}  // namespace replica::ops::cuk
