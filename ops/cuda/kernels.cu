// The hand-written CUDA kernels of the op backend: elementwise ops, casts, batch norm, pooling,
// softmax cross-entropy, reductions and the fused optimizer updates. Each mirrors a loop of the
// CPU backend (ops/cpu/) so the conformance tests can hold them to it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <initializer_list>
#include <string>

#include "core/cuda/check.h"
#include "core/errors.h"
#include "ops/cuda/kernels.h"

namespace replica::ops::cuk {
namespace {

constexpr int kF16 = 1, kBF16 = 2;
constexpr int kThreads = 256;

__device__ __forceinline__ float ld(const void* p, int dt, int64_t i) {
  if (dt == kF16) return __half2float(static_cast<const __half*>(p)[i]);
  if (dt == kBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

__device__ __forceinline__ void st(void* p, int dt, int64_t i, float v) {
  if (dt == kF16) static_cast<__half*>(p)[i] = __float2half_rn(v);
  else if (dt == kBF16) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  else static_cast<float*>(p)[i] = v;
}

int grid_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(std::clamp<int64_t>(b, 1, 1 << 20));  // grid-stride loops cover the rest
}

void check_launch(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw CudaError(std::string("CUDA kernel ") + what + " failed to launch: " + cudaGetErrorString(e));
}

#define GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// Grid-stride over n, kUnroll elements per thread and round, every load of a round issued before
// its stores: a plain loop keeps one 2-byte load per thread in flight, too few bytes to approach
// the memory bandwidth with 16-bit activations. value(i) loads and computes element i, put(i, v)
// stores it; in-place use is safe (each element is loaded before it is stored). Launch with
// grid_unrolled(n).
constexpr int kUnroll = 4;
template <typename Value, typename Put>
__device__ __forceinline__ void unrolled(int64_t n, Value value, Put put) {
  const int64_t step = static_cast<int64_t>(blockDim.x);
  const int64_t round = static_cast<int64_t>(gridDim.x) * step * kUnroll;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * step * kUnroll + threadIdx.x; base < n; base += round) {
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * step;
      if (i < n) v[u] = value(i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * step;
      if (i < n) put(i, v[u]);
    }
  }
}

// ---- 16-byte vectors ----------------------------------------------------------------------------
// The memory-bound kernels move 8 elements per thread and access: one 16-byte load or store for
// 16-bit types, two for f32, with the storage type a template parameter (PyTorch's
// aligned_vector, llm.c's x128) instead of a run-time switch per element. Conversions round to
// nearest even, as ld/st do, so a vector kernel's bits equal its scalar twin's. Used when every
// pointer is 16-byte aligned (pool blocks are 256-byte aligned; a view may not be); the scalar
// kernels stay for the rest.
constexpr int kVec = 8;

__device__ __forceinline__ void load8(const float* p, float (&v)[kVec]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load8(const __half* p, float (&v)[kVec]) {
  uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    v[2 * i] = f.x, v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[kVec]) {
  uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x, v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void store8(float* p, const float (&v)[kVec]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store8(__half* p, const float (&v)[kVec]) {
  uint4 raw;
  __half2* h = reinterpret_cast<__half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&v)[kVec]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}
template <typename T>
__device__ __forceinline__ float to_float(T v) {
  return static_cast<float>(v);
}
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

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

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Runs f with T the C++ type of storage dtype dt (f32, f16 or bf16).
template <typename F>
void with_type(int dt, F&& f) {
  if (dt == kF16) f(__half{});
  else if (dt == kBF16) f(__nv_bfloat16{});
  else f(float{});
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

// ---- reductions -------------------------------------------------------------------------------

// Sums v over the block into thread 0's return value.
__device__ double block_sum(double v) {
  __shared__ double sh[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  v = threadIdx.x < warps ? sh[threadIdx.x] : 0.0;
  if (warp == 0)
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  __syncthreads();  // sh may be reused by a following call
  return v;
}

// Every reduction here is deterministic: each block writes its partial sum, and one pass adds the
// partials in index order (no float or double atomics, whose order varies from run to run).
__global__ void k_sum_squares(const float* x, int64_t n, double* part) {
  double acc = 0;
  GRID_STRIDE(i, n) acc += static_cast<double>(x[i]) * x[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

// *out = the sum of part[0, n): one block, each thread a fixed stride, then the fixed shuffle tree.
__global__ void k_sum_partials(const double* part, int64_t n, double* out) {
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += part[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) *out = acc;
}

__global__ void k_segment_sum_squares(const float* x, const int64_t* off, const int64_t* cnt, double* out) {
  const int seg = blockIdx.x;
  double acc = 0;
  for (int64_t i = threadIdx.x; i < cnt[seg]; i += blockDim.x) {
    const double v = x[off[seg] + i];
    acc += v * v;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) out[seg] = acc;
}

// Index order, one thread adding: a few thousand block sums (ResNet-50's gradient norm: ~6400),
// the same bits every run. The block stages them through shared memory in coalesced tiles first,
// so the adding thread waits on shared memory, not on a global load per element (about 0.3 ms of
// L2 round trips for 6400 sums, one thread alone).
constexpr int kOrderTile = 4096;
__global__ void k_sum_in_order(const float* x, int64_t n, float* out) {
  __shared__ float tile[kOrderTile];
  double acc = 0;  // thread 0's
  for (int64_t base = 0; base < n; base += kOrderTile) {
    const int m = static_cast<int>(n - base < kOrderTile ? n - base : kOrderTile);
    for (int i = threadIdx.x; i < m; i += blockDim.x) tile[i] = x[base + i];
    __syncthreads();
    if (threadIdx.x == 0)
      for (int i = 0; i < m; ++i) acc += tile[i];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = static_cast<float>(acc);
}

// LARS trust ratios in two passes: a block per fixed-size chunk of a tensor adds both squared
// norms in double (part[2k], part[2k + 1]); then a thread per tensor adds its chunks' sums in
// order and forms the ratio (CPU: optim_kernels.cpp). A block per whole tensor left ResNet-50's
// largest (2.4M weights, 19 MB read) to one multiprocessor while the others idled.
__global__ void k_lars_chunk_sums(const float* w, const float* g, const int64_t* off, const int64_t* cnt,
                                  double* part) {
  const int k = blockIdx.x;
  double ws = 0, gs = 0;
  for (int64_t i = threadIdx.x; i < cnt[k]; i += blockDim.x) {
    const double a = w[off[k] + i], b = g[off[k] + i];
    ws += a * a;
    gs += b * b;
  }
  ws = block_sum(ws);
  gs = block_sum(gs);
  if (threadIdx.x == 0) part[2 * k] = ws, part[2 * k + 1] = gs;
}
__global__ void k_lars_ratios(const double* part, const int64_t* first, const int64_t* chunks, int segments,
                              float trust, float wd, float eps, float* out) {
  const int seg = blockIdx.x * blockDim.x + threadIdx.x;
  if (seg >= segments) return;
  double ws = 0, gs = 0;
  for (int64_t k = first[seg]; k < first[seg] + chunks[seg]; ++k) ws += part[2 * k], gs += part[2 * k + 1];
  const double wn = sqrt(ws), gn = sqrt(gs);
  out[seg] = wn > 0 && gn > 0 ? static_cast<float>(trust * wn / (gn + wd * wn + eps)) : 1.f;
}

template <typename Flag>
__global__ void k_unscale_check(float* g, int64_t n, Knob inv_scale, Flag* nonfinite) {
  const float inv = inv_scale.get();
  bool bad = false;
  GRID_STRIDE(i, n) {
    const float v = g[i];
    bad |= !isfinite(v);
    g[i] = v * inv;
  }
  if (bad) *nonfinite = Flag(1);
}

// ---- optimizers -------------------------------------------------------------------------------

// One thread: the step's verdict and clip factor from its scalars (Backend::step_gate; the CPU's
// formula, in double for the norm).
__global__ void k_step_gate(float* s, int64_t loss, int64_t bad_label, int64_t nonfinite, int64_t grad_squares,
                            int64_t apply, int64_t clip, double max_norm) {
  s[apply] = s[nonfinite] == 0.f && s[bad_label] == 0.f && isfinite(s[loss]) ? 1.f : 0.f;
  const double norm = sqrt(static_cast<double>(s[grad_squares]));
  s[clip] = max_norm > 0 && norm > max_norm ? static_cast<float>(max_norm / (norm + 1e-6)) : 1.f;
}

__global__ void k_scale_by(float* y, int64_t n, const float* factor) {
  const float f = *factor;
  GRID_STRIDE(i, n) y[i] *= f;
}


// Each update stores the new parameter and, when `copy` is given, its rounding into the 16-bit
// compute copy (st: cast's rounding): the copy costs 2 bytes written, not another pass.
__device__ __forceinline__ void store_param(float* p, DPtr copy, int64_t i, float v) {
  p[i] = v;
  if (copy.p) st(copy.mut(), copy.dt, i, v);
}

// Every group of the flat buffer in one launch: an element's group coefficients come from its
// chunk's entry in the group table (one byte or int per 16 elements, read by 16 neighbouring
// threads at once), chosen by selects, so each element computes what a call per group computed.
// The per-element pieces are shared by the scalar kernels and the 16-byte vector ones below, so
// the two give the same bits.
__device__ __forceinline__ bool closed(const float* gate) { return gate && *gate == 0.f; }  // a skipped step
__device__ __forceinline__ bool decays(const uint8_t* cls, int64_t base, int64_t i) {
  return !cls || cls[(base + i) >> kChunkShift] != 0;
}
// LARS: the element's learning rate times its trust ratio, and its weight decay (none unadapted).
__device__ __forceinline__ float2 lars_coefficients(const int32_t* cls, int64_t base, int64_t i, float lr,
                                                   const float* ratios, float wd) {
  const int32_t k = cls[(base + i) >> kChunkShift];
  return k >= 0 ? make_float2(lr * ratios[k], wd) : make_float2(lr, 0.f);
}
// One element's update: the new parameter, its state updated in place (PyTorch's order of
// operations, as ops/cpu/optim_kernels.cpp).
__device__ __forceinline__ float sgd_one(float p, float g, float& b, float lr, float m, float cwd, float dwd,
                                         bool nesterov, bool first) {
  float d = g + cwd * p;
  if (m != 0.f) {
    b = first ? d : m * b + d;
    d = nesterov ? d + m * b : b;
  }
  return p - (lr * d + dwd * p);
}
__device__ __forceinline__ float adamw_one(float p, float g, float& m, float& v, float b1, float b2, float eps,
                                           float decay, float step, float inv_sqrt_bc2) {
  const float pd = p * decay;
  m = b1 * m + (1.f - b1) * g;
  v = b2 * v + (1.f - b2) * g * g;
  return pd - step * m / (sqrtf(v) * inv_sqrt_bc2 + eps);
}
__device__ __forceinline__ float lars_one(float p, float g, float& b, float2 c, float m) {
  b = m * b + c.x * (g + c.y * p);
  return p - b;
}

__global__ void k_sgd(float* p, const float* g, float* buf, int64_t n, const uint8_t* cls, int64_t base, Knob lr_k,
                      float m, float cwd, Knob dwd_k, bool nesterov, Knob first_k, DPtr copy, const float* gate) {
  if (closed(gate)) return;
  const float lr = lr_k.get(), dwd = dwd_k.get();
  const bool first = first_k.get() != 0.f;
  GRID_STRIDE(i, n) {
    const bool d = decays(cls, base, i);
    float b = m != 0.f && !first ? buf[i] : 0.f;  // the first step starts the buffer
    const float v = sgd_one(p[i], g[i], b, lr, m, d ? cwd : 0.f, d ? dwd : 0.f, nesterov, first);
    if (m != 0.f) buf[i] = b;
    store_param(p, copy, i, v);
  }
}

__global__ void k_adamw(float* p, const float* g, float* m, float* v, int64_t n, const uint8_t* cls, int64_t base,
                        float b1, float b2, float eps, Knob decay_k, Knob step_k, Knob ibc2_k, DPtr copy,
                        const float* gate) {
  if (closed(gate)) return;
  const float decay = decay_k.get(), step = step_k.get(), inv_sqrt_bc2 = ibc2_k.get();
  GRID_STRIDE(i, n) {
    float mi = m[i], vi = v[i];
    const float pv = adamw_one(p[i], g[i], mi, vi, b1, b2, eps, decays(cls, base, i) ? decay : 1.f, step, inv_sqrt_bc2);
    m[i] = mi;
    v[i] = vi;
    store_param(p, copy, i, pv);
  }
}

__global__ void k_lars(float* p, const float* g, float* buf, int64_t n, const int32_t* cls, int64_t base, Knob lr_k,
                       const float* ratios, float m, float wd, DPtr copy, const float* gate) {
  if (closed(gate)) return;
  const float lr = lr_k.get();
  GRID_STRIDE(i, n) {
    float b = buf[i];
    const float v = lars_one(p[i], g[i], b, lars_coefficients(cls, base, i, lr, ratios, wd), m);
    buf[i] = b;
    store_param(p, copy, i, v);
  }
}

// The same three updates, 8 elements a thread in 16-byte accesses (the parameters, gradients and
// state two float4s each, the 16-bit copy one 16-byte store), the copy's type a template
// parameter: the scalar kernels above read and write one 4-byte word per thread and access, and
// round into the copy through a run-time switch. Used when every buffer is 16-byte aligned and
// the range's first flat element is a multiple of 8 (8 elements never straddle a group-table
// chunk); the scalar kernels take the rest and the tail.
template <typename T>
__device__ __forceinline__ void store_params8(float* p, T* copy, int64_t i, const float (&v)[kVec]) {
  store8(p + i, v);
  if (copy) store8(copy + i, v);
}

template <typename T>
__global__ void k_sgd8(float* p, const float* g, float* buf, int64_t nv, const uint8_t* cls, int64_t base, Knob lr_k,
                       float m, float cwd, Knob dwd_k, bool nesterov, Knob first_k, T* copy, const float* gate) {
  if (closed(gate)) return;
  const float lr = lr_k.get(), dwd = dwd_k.get();
  const bool first = first_k.get() != 0.f;
  GRID_STRIDE(v, nv) {
    const int64_t i = v * kVec;
    const bool d = decays(cls, base, i);
    float pv[kVec], gv[kVec], bv[kVec] = {};
    load8(p + i, pv);
    load8(g + i, gv);
    if (m != 0.f && !first) load8(buf + i, bv);
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      pv[j] = sgd_one(pv[j], gv[j], bv[j], lr, m, d ? cwd : 0.f, d ? dwd : 0.f, nesterov, first);
    if (m != 0.f) store8(buf + i, bv);
    store_params8(p, copy, i, pv);
  }
}

template <typename T>
__global__ void k_adamw8(float* p, const float* g, float* m, float* v, int64_t nv, const uint8_t* cls, int64_t base,
                         float b1, float b2, float eps, Knob decay_k, Knob step_k, Knob ibc2_k, T* copy,
                         const float* gate) {
  if (closed(gate)) return;
  const float decay = decay_k.get(), step = step_k.get(), inv_sqrt_bc2 = ibc2_k.get();
  GRID_STRIDE(k, nv) {
    const int64_t i = k * kVec;
    const float dc = decays(cls, base, i) ? decay : 1.f;
    float pv[kVec], gv[kVec], mv[kVec], vv[kVec];
    load8(p + i, pv);
    load8(g + i, gv);
    load8(m + i, mv);
    load8(v + i, vv);
#pragma unroll
    for (int j = 0; j < kVec; ++j) pv[j] = adamw_one(pv[j], gv[j], mv[j], vv[j], b1, b2, eps, dc, step, inv_sqrt_bc2);
    store8(m + i, mv);
    store8(v + i, vv);
    store_params8(p, copy, i, pv);
  }
}

template <typename T>
__global__ void k_lars8(float* p, const float* g, float* buf, int64_t nv, const int32_t* cls, int64_t base, Knob lr_k,
                        const float* ratios, float m, float wd, T* copy, const float* gate) {
  if (closed(gate)) return;
  const float lr = lr_k.get();
  GRID_STRIDE(v, nv) {
    const int64_t i = v * kVec;
    const float2 c = lars_coefficients(cls, base, i, lr, ratios, wd);
    float pv[kVec], gv[kVec], bv[kVec];
    load8(p + i, pv);
    load8(g + i, gv);
    load8(buf + i, bv);
#pragma unroll
    for (int j = 0; j < kVec; ++j) pv[j] = lars_one(pv[j], gv[j], bv[j], c, m);
    store8(buf + i, bv);
    store_params8(p, copy, i, pv);
  }
}

// ---- batch norm -------------------------------------------------------------------------------
// Blocks of 32 channels x 8 row lanes; each thread folds f32 partials of 32 rows into a double
// (the CPU backend's scheme), the block combines its 8 lanes and writes one double per channel
// and block row; k_bn_fold then adds the block rows in index order (no atomics: the same bits in
// every run).

constexpr int kBnRows = 8;

// Combines the kBnRows row lanes of a 32-channel block and writes channel c's two sums as this
// block row's partials part[y][c] and part[y][C + c] (part: [gridDim.y][2C]). Every thread of the
// block calls it.
__device__ void write_channel_partials(double t1, double t2, int C, int c, double* part) {
  __shared__ double s1[kBnRows][32], s2[kBnRows][32];
  s1[threadIdx.y][threadIdx.x] = t1;
  s2[threadIdx.y][threadIdx.x] = t2;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    double a = 0, b = 0;
    for (int j = 0; j < kBnRows; ++j) {
      a += s1[j][threadIdx.x];
      b += s2[j][threadIdx.x];
    }
    double* row = part + static_cast<int64_t>(blockIdx.y) * 2 * C;
    row[c] = a;
    row[C + c] = b;
  }
}

// out1[c] = sum over block rows r of part[r][c], out2[c] likewise of part[r][C + c], r ascending;
// then the fold's epilogue (kernels.h, BnFold): what were two more launches per batch norm.
__device__ __forceinline__ void bn_fold_epilogue(const BnFold& e, int c, double s1, double s2) {
  if (e.add1) e.add1[c] += static_cast<float>(s1);
  if (e.add2) e.add2[c] += static_cast<float>(s2);
}
__global__ void k_bn_fold(const double* part, int rows, int C, double* out1, double* out2, BnFold e) {
  if (e.count_at && blockIdx.x == 0 && threadIdx.x == 0) *e.count_at = e.count;
  GRID_STRIDE(c, C) {
    double a = 0, b = 0;
    for (int r = 0; r < rows; ++r) {
      a += part[static_cast<int64_t>(r) * 2 * C + c];
      b += part[static_cast<int64_t>(r) * 2 * C + C + c];
    }
    out1[c] = a;
    out2[c] = b;
    bn_fold_epilogue(e, c, a, b);
  }
}

// Channel c's two sums over the rows of [M, C] in this thread's share (rows strided over the
// grid's y), kUnroll rows a round with independent loads, f32 partials folded into double every
// 32 rows. term(i) gives element i's two addends.
template <typename Term>
__device__ __forceinline__ double2 channel_row_sums(int64_t M, int C, int c, Term term) {
  double2 t = make_double2(0.0, 0.0);
  const int64_t S = static_cast<int64_t>(gridDim.y) * kBnRows;
  float p1 = 0.f, p2 = 0.f;
  int k = 0;
  for (int64_t r = blockIdx.y * kBnRows + threadIdx.y; r < M; r += kUnroll * S) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t rr = r + u * S;
      if (rr < M) {
        const float2 v = term(rr * C + c);
        p1 += v.x;
        p2 += v.y;
      }
    }
    if (++k == 32 / kUnroll) {
      t.x += p1;
      t.y += p2;
      p1 = p2 = 0.f;
      k = 0;
    }
  }
  t.x += p1;
  t.y += p2;
  return t;
}

// The shift of the one-pass moments: the running mean (close to the batch mean, so the f32
// partial sums keep their digits; the same on every replica under sync-BN, so the shifted sums
// can be added across replicas), or 0 where it is not finite: one overflowed running mean must
// not turn every later training-mode output of its channel into NaN.
__device__ __forceinline__ float bn_shift(const float* shift, int c) {
  const float k = shift ? shift[c] : 0.f;
  return isfinite(k) ? k : 0.f;
}

__global__ void k_bn_moments(DPtr x, int64_t M, int C, const float* shift, double* part) {
  const int c = blockIdx.x * 32 + threadIdx.x;
  double2 t = make_double2(0.0, 0.0);
  if (c < C) {
    const float k0 = bn_shift(shift, c);
    t = channel_row_sums(M, C, c, [&](int64_t i) {
      const float d = ld(x.p, x.dt, i) - k0;
      return make_float2(d, d * d);
    });
  }
  write_channel_partials(t.x, t.y, C, c, part);
}

// The gradient reaching batch norm: dy, or zero where a fused ReLU's output was not positive;
// with a ReLU the masked value is written back to dy (the element's only reader and writer is
// this thread), for the apply pass and a residual's shortcut to read.
__device__ __forceinline__ float masked_dy(DPtr dy, DPtr ry, int64_t i) {
  const float g = ld(dy.p, dy.dt, i);
  if (!ry.p) return g;
  if (ld(ry.p, ry.dt, i) > 0.f) return g;
  st(dy.mut(), dy.dt, i, 0.f);
  return 0.f;
}

__global__ void k_bn_bwd_sums(DPtr dy, DPtr ry, DPtr x, int64_t M, int C, const float* mean, const float* invstd,
                              double* part) {
  const int c = blockIdx.x * 32 + threadIdx.x;
  double2 t = make_double2(0.0, 0.0);
  if (c < C) {
    const float mu = mean[c], inv = invstd[c];
    t = channel_row_sums(M, C, c, [&](int64_t i) {
      const float g = masked_dy(dy, ry, i);
      return make_float2(g, g * (ld(x.p, x.dt, i) - mu) * inv);
    });
  }
  write_channel_partials(t.x, t.y, C, c, part);
}

dim3 bn_grid(int64_t M, int C) {
  const int cx = (C + 31) / 32;
  // About 1024 blocks of 256 threads (a full wave on 132 SMs) without tiny per-thread chunks.
  const int64_t want = std::max<int64_t>(1, 1024 / cx);
  const int64_t rows = std::clamp<int64_t>((M + kBnRows * 64 - 1) / (kBnRows * 64), 1, want);
  return dim3(cx, static_cast<unsigned>(rows));
}

__global__ void k_d2f(const double* a, float* f, int n) {
  GRID_STRIDE(i, n) f[i] = static_cast<float>(a[i]);
}
__global__ void k_f2d(const float* f, double* a, int n) {
  GRID_STRIDE(i, n) a[i] = f[i];
}
// Folds one loss kernel's results into the step's f32 sums (the step reads them once).
__global__ void k_xent_fold(const double* result, const int* counts, float* sums) {
  sums[0] += static_cast<float>(*result);
  sums[1] += static_cast<float>(counts[0]);
  if (counts[1]) sums[2] += 1.f;
}

__global__ void k_bn_finalize(const double* acc, int C, DPtr gamma, DPtr beta, float eps, float momentum, float* sm,
                              float* si, float* rm, float* rv, float* a, float* b) {
  GRID_STRIDE(c, C) {
    const double Mg = acc[C];
    const double d1 = acc[c] / Mg;           // mean - shift
    const double mean = bn_shift(rm, c) + d1;  // the shift k_bn_moments used, read before rm moves
    const double var = fmax(acc[C + 1 + c] / Mg - d1 * d1, 0.0);
    const double inv = 1.0 / sqrt(var + eps);
    const float g = ld(gamma.p, gamma.dt, c), be = ld(beta.p, beta.dt, c);
    sm[c] = static_cast<float>(mean);
    si[c] = static_cast<float>(inv);
    a[c] = static_cast<float>(g * inv);
    b[c] = static_cast<float>(be - mean * g * inv);
    const double unbiased = Mg > 1 ? var * Mg / (Mg - 1) : var;
    rm[c] = static_cast<float>((1 - momentum) * rm[c] + momentum * mean);
    rv[c] = static_cast<float>((1 - momentum) * rv[c] + momentum * unbiased);
  }
}

__global__ void k_bn_coef_eval(DPtr gamma, DPtr beta, const float* rm, const float* rv, float eps, int C, float* a,
                               float* b) {
  GRID_STRIDE(c, C) {
    const float inv = 1.0f / sqrtf(rv[c] + eps);
    a[c] = ld(gamma.p, gamma.dt, c) * inv;
    b[c] = ld(beta.p, beta.dt, c) - rm[c] * a[c];
  }
}

// The [M, C] passes of batch norm run on the statistics' grid (a fixed channel per thread, rows
// strided): no per-element index division, and the channel's coefficients stay in registers.
// res.p: a residual added before the ReLU (a residual block's join).
__global__ void k_bn_apply(DPtr x, DPtr res, DPtr y, int64_t M, int C, const float* a, const float* b, bool relu) {
  const int c = blockIdx.x * 32 + threadIdx.x;
  if (c >= C) return;
  const float ac = a[c], bc = b[c];
  const int64_t S = static_cast<int64_t>(gridDim.y) * kBnRows;
  for (int64_t r = blockIdx.y * kBnRows + threadIdx.y; r < M; r += kUnroll * S) {
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t rr = r + u * S;
      if (rr < M) {
        v[u] = ld(x.p, x.dt, rr * C + c) * ac + bc;
        if (res.p) v[u] += ld(res.p, res.dt, rr * C + c);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t rr = r + u * S;
      if (rr < M) st(y.mut(), y.dt, rr * C + c, relu && v[u] < 0.f ? 0.f : v[u]);
    }
  }
}

// dy arrives masked (a fused ReLU's mask was applied in place by the sums pass).
__global__ void k_bn_bwd_apply(DPtr dy, DPtr x, DPtr gamma, const float* mean, const float* invstd,
                               const double* acc, DPtr dx, int64_t M, int C) {
  const int c = blockIdx.x * 32 + threadIdx.x;
  if (c >= C) return;
  const float inv = invstd[c], mu = mean[c];
  const float k = ld(gamma.p, gamma.dt, c) * inv;
  float m1 = 0.f, m2 = 0.f;  // frozen statistics (acc == null): dx = k * dy
  if (acc) {
    const double Mg = acc[2 * C];
    m1 = static_cast<float>(acc[c] / Mg);
    m2 = static_cast<float>(acc[C + c] / Mg);
  }
  const int64_t S = static_cast<int64_t>(gridDim.y) * kBnRows;
  for (int64_t r = blockIdx.y * kBnRows + threadIdx.y; r < M; r += kUnroll * S) {
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t rr = r + u * S;
      if (rr < M) {
        const int64_t i = rr * C + c;
        const float g = ld(dy.p, dy.dt, i);
        v[u] = acc ? k * (g - m1 - (ld(x.p, x.dt, i) - mu) * inv * m2) : k * g;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t rr = r + u * S;
      if (rr < M) st(dx.mut(), dx.dt, rr * C + c, v[u]);
    }
  }
}

// The same two passes in 8-channel vectors (k_map8's loads), for C a multiple of 8 whose channel
// vectors CV = C / 8 divide the block: a thread keeps one channel vector and its coefficients in
// registers for all its rows (the grid's thread count is a multiple of CV, so striding over the
// tensor's vectors keeps a thread's channels), and no index is divided per element.
template <typename T>
__global__ void k_bn_apply8(const T* x, const T* res, T* y, int64_t M, int C, const float* a, const float* b,
                            bool relu) {
  const int CV = C / kVec;
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int c0 = static_cast<int>(t % CV) * kVec;
  float ac[kVec], bc[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) ac[j] = a[c0 + j], bc[j] = b[c0 + j];
  const int64_t rows = static_cast<int64_t>(gridDim.x) * blockDim.x / CV;
  for (int64_t r = t / CV; r < M; r += rows) {
    float v[kVec], rv[kVec] = {};
    load8(x + r * C + c0, v);
    if (res) load8(res + r * C + c0, rv);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      v[j] = v[j] * ac[j] + bc[j];
      if (res) v[j] += rv[j];
      if (relu && v[j] < 0.f) v[j] = 0.f;
    }
    store8(y + r * C + c0, v);
  }
}

template <typename T>
__global__ void k_bn_bwd_apply8(const T* dy, const T* x, DPtr gamma, const float* mean,
                                const float* invstd, const double* acc, T* dx, int64_t M, int C) {
  const int CV = C / kVec;
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int c0 = static_cast<int>(t % CV) * kVec;
  float k[kVec], mu[kVec], inv[kVec], m1[kVec], m2[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const int c = c0 + j;
    inv[j] = invstd[c], mu[j] = mean[c];
    k[j] = ld(gamma.p, gamma.dt, c) * inv[j];
    m1[j] = m2[j] = 0.f;  // frozen statistics (acc == null): dx = k * dy
    if (acc) {
      const double Mg = acc[2 * C];
      m1[j] = static_cast<float>(acc[c] / Mg);
      m2[j] = static_cast<float>(acc[C + c] / Mg);
    }
  }
  const int64_t rows = static_cast<int64_t>(gridDim.x) * blockDim.x / CV;
  for (int64_t r = t / CV; r < M; r += rows) {
    const int64_t i = r * C + c0;
    float g[kVec], xv[kVec], o[kVec];
    load8(dy + i, g);  // masked already, when a ReLU was fused
    load8(x + i, xv);
#pragma unroll
    for (int j = 0; j < kVec; ++j) o[j] = acc ? k[j] * (g[j] - m1[j] - (xv[j] - mu[j]) * inv[j] * m2[j]) : k[j] * g[j];
    store8(dx + i, o);
  }
}

// Batch norm's two per-channel sums in 8-channel vectors (the forward's shifted moments, or the
// backward's sum of dy and of dy * xhat): a block is CV channel-vector lanes x RL = kThreads / CV
// row lanes. Each thread adds its rows (strided over the grid's row lanes, two per round with
// their loads issued first) into f32 partials folded into double every 32 rows, as the scalar
// kernels do; the block adds its row lanes in lane order into one partial per channel and block,
// part[block][c] and part[block][C + c]; k_bn_fold_rows adds the blocks in order. No atomics.
constexpr int kBnSumBlocks = 1056;  // 8 blocks on each of an H100/H200's 132 multiprocessors
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads, 2) k_bn_sums8(const T* a, const T* ry, const T* x, int64_t M, int C,
                                                     const float* p0, const float* p1, double* part) {
  // Rows a round: their loads go out together (the forward reads one tensor, the backward two or
  // three: fewer rows keep its registers, and so its occupancy, up).
  constexpr int kRows = kBackward ? 2 : 4;
  const int CV = C / kVec, RL = kThreads / CV;
  const int cv = static_cast<int>(threadIdx.x) % CV, rl = static_cast<int>(threadIdx.x) / CV, c0 = cv * kVec;
  // Each thread's double sums live in shared memory (registers hold the f32 partials only).
  __shared__ double sh[kThreads][2 * kVec + 1];
  float k0[kVec], k1[kVec], s1[kVec], s2[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    k0[j] = kBackward ? p0[c0 + j] : bn_shift(p0, c0 + j);  // the mean, or the moments' shift
    k1[j] = kBackward ? p1[c0 + j] : 0.f;                    // the inverse deviation
    s1[j] = s2[j] = 0.f;
    sh[threadIdx.x][j] = sh[threadIdx.x][kVec + j] = 0.0;
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * RL;
  int k = 0;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * RL + rl; r < M; r += kRows * stride) {
    float v[kRows][kVec], xv[kRows][kVec];
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int64_t ru = r + u * stride;
      if (ru < M) {
        load8(a + ru * C + c0, v[u]);
        if (kBackward) load8(x + ru * C + c0, xv[u]);
      }
    }
    if (kBackward && ry) {  // the fused ReLU's mask: dy counts where its output was positive
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        const int64_t ru = r + u * stride;
        if (ru < M) {
          float m[kVec];
          load8(ry + ru * C + c0, m);
#pragma unroll
          for (int j = 0; j < kVec; ++j) v[u][j] = m[j] > 0.f ? v[u][j] : 0.f;
          // Written back: the apply pass and a residual's shortcut read the masked gradient
          // (this thread is the rows' only reader and writer).
          store8(const_cast<T*>(a) + ru * C + c0, v[u]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      if (r + u * stride >= M) break;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if (kBackward) {
          s1[j] += v[u][j];
          s2[j] += v[u][j] * (xv[u][j] - k0[j]) * k1[j];
        } else {
          const float d = v[u][j] - k0[j];
          s1[j] += d;
          s2[j] += d * d;
        }
      }
    }
    if (++k == 32 / kRows) {  // 32 rows: into double
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        sh[threadIdx.x][j] += s1[j];
        sh[threadIdx.x][kVec + j] += s2[j];
        s1[j] = s2[j] = 0.f;
      }
      k = 0;
    }
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    sh[threadIdx.x][j] += s1[j];
    sh[threadIdx.x][kVec + j] += s2[j];
  }
  __syncthreads();
  for (int q = threadIdx.x; q < 2 * C; q += blockDim.x) {
    const int kind = q / C, c = q % C;
    double acc = 0;
    for (int l = 0; l < RL; ++l) acc += sh[l * CV + c / kVec][kind * kVec + c % kVec];
    part[static_cast<int64_t>(blockIdx.x) * 2 * C + q] = acc;
  }
}

// out1[c] = sum over blocks b of part[b][c], out2[c] likewise of part[b][C + c], in a fixed order:
// 32 lanes each add every 32nd block in order, then the lanes are added in order. Blocks of 32
// columns x 32 lanes.
__global__ void k_bn_fold_rows(const double* part, int rows, int C, double* out1, double* out2, BnFold e) {
  __shared__ double sh[32][33];
  if (e.count_at && blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0) *e.count_at = e.count;
  const int q = blockIdx.x * 32 + threadIdx.x;
  double acc = 0;
  if (q < 2 * C)
    for (int r = threadIdx.y; r < rows; r += 32) acc += part[static_cast<int64_t>(r) * 2 * C + q];
  sh[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && q < 2 * C) {
    double t = 0;
    for (int l = 0; l < 32; ++l) t += sh[l][threadIdx.x];
    if (q < C) {
      out1[q] = t;
      if (e.add1) e.add1[q] += static_cast<float>(t);
    } else {
      out2[q - C] = t;
      if (e.add2) e.add2[q - C] += static_cast<float>(t);
    }
  }
}

// Whether the 8-channel forms serve these tensors (all of one dtype, 16-byte aligned).
bool bn_vectors(int C, std::initializer_list<DPtr> ts) {
  if (C % kVec != 0 || kThreads % (C / kVec) != 0) return false;
  const int dt = ts.begin()->dt;
  for (const DPtr& t : ts)
    if (t.p && (t.dt != dt || !aligned16(t.p))) return false;
  return true;
}

// ---- pooling ----------------------------------------------------------------------------------

// Pooling index math in I: 32-bit when the tensor allows (a 64-bit division costs several times
// a 32-bit one, and these kernels do four per element). The launchers take 32 bits below 2^30
// elements, so index + grid stride (at most 2^28) cannot overflow.
// A flat index over [N, A, B, K] (channels last) split into its coordinates (n, a, b, k).
template <typename I>
__device__ __forceinline__ int4 split_index(I i, int A, int B, int K) {
  const int k = static_cast<int>(i % K);
  I t = i / K;
  const int b = static_cast<int>(t % B);
  t /= B;
  const int a = static_cast<int>(t % A);
  return make_int4(static_cast<int>(t / A), a, b, k);
}

template <typename I>
__global__ void k_maxpool(DPtr x, DPtr y, int32_t* arg, int N, int H, int W, int C, int P, int Q, int win, int stride,
                          int pad) {
  const I total = static_cast<I>(N) * P * Q * C;
  for (I i = blockIdx.x * static_cast<I>(blockDim.x) + threadIdx.x; i < total; i += static_cast<I>(gridDim.x) * blockDim.x) {
    const int4 at = split_index(i, P, Q, C);
    const int n = at.x, p = at.y, q = at.z, c = at.w;
    float best = -INFINITY;
    int besti = -1;
    for (int r = 0; r < win; ++r) {
      const int h = p * stride - pad + r;
      if (h < 0 || h >= H) continue;
      for (int s = 0; s < win; ++s) {
        const int w = q * stride - pad + s;
        if (w < 0 || w >= W) continue;
        const float v = ld(x.p, x.dt, ((static_cast<I>(n) * H + h) * W + w) * C + c);
        if (v > best || besti < 0) {
          best = v;
          besti = h * W + w;
        }
      }
    }
    st(y.mut(), y.dt, i, best);
    arg[i] = besti;
  }
}

// Gather form: each input element sums the outputs whose argmax it is, in the CPU backend's order.
template <typename I>
__global__ void k_maxpool_bwd(DPtr dy, const int32_t* arg, DPtr dx, int N, int H, int W, int C, int P, int Q, int win,
                              int stride, int pad) {
  const I total = static_cast<I>(N) * H * W * C;
  for (I i = blockIdx.x * static_cast<I>(blockDim.x) + threadIdx.x; i < total; i += static_cast<I>(gridDim.x) * blockDim.x) {
    const int4 at = split_index(i, H, W, C);
    const int n = at.x, h = at.y, w = at.z, c = at.w;
    const int hp = h + pad, wp = w + pad;
    const int p0 = hp < win ? 0 : (hp - win) / stride + 1, p1 = min(P - 1, hp / stride);
    const int q0 = wp < win ? 0 : (wp - win) / stride + 1, q1 = min(Q - 1, wp / stride);
    float sum = 0.f;
    for (int p = p0; p <= p1; ++p)
      for (int q = q0; q <= q1; ++q) {
        const I o = ((static_cast<I>(n) * P + p) * Q + q) * C + c;
        if (arg[o] == h * W + w) sum += ld(dy.p, dy.dt, o);
      }
    st(dx.mut(), dx.dt, i, sum);
  }
}

// The same two passes in 8-channel vectors (C a multiple of 8, every tensor 16-byte aligned): a
// thread owns one pixel's 8 channels, so the index math is done once for 8 elements and every access
// is one 16-byte load or store (the argmax's two). The same comparisons, and the same order of
// additions, as the scalar kernels: the same bits. The gather reads dy only for the windows whose
// argmax picked this pixel in one of its channels.
template <typename T, typename I>
__global__ void k_maxpool8(const T* x, T* y, int32_t* arg, int N, int H, int W, int C, int P, int Q, int win,
                           int stride, int pad) {
  const int CV = C / kVec;
  const I total = static_cast<I>(N) * P * Q * CV;
  for (I i = blockIdx.x * static_cast<I>(blockDim.x) + threadIdx.x; i < total; i += static_cast<I>(gridDim.x) * blockDim.x) {
    const int4 at = split_index(i, P, Q, CV);
    const int n = at.x, p = at.y, q = at.z, cv = at.w;
    float best[kVec];
    int besti[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) best[j] = -INFINITY, besti[j] = -1;
    for (int r = 0; r < win; ++r) {
      const int h = p * stride - pad + r;
      if (h < 0 || h >= H) continue;
      for (int s = 0; s < win; ++s) {
        const int w = q * stride - pad + s;
        if (w < 0 || w >= W) continue;
        float v[kVec];
        load8(x + ((static_cast<I>(n) * H + h) * W + w) * C + cv * kVec, v);
        const int idx = h * W + w;
#pragma unroll
        for (int j = 0; j < kVec; ++j)
          if (v[j] > best[j] || besti[j] < 0) best[j] = v[j], besti[j] = idx;
      }
    }
    store8(y + i * kVec, best);
    int4* a = reinterpret_cast<int4*>(arg + i * kVec);
    a[0] = make_int4(besti[0], besti[1], besti[2], besti[3]);
    a[1] = make_int4(besti[4], besti[5], besti[6], besti[7]);
  }
}

template <typename T, typename I>
__global__ void k_maxpool_bwd8(const T* dy, const int32_t* arg, T* dx, int N, int H, int W, int C, int P, int Q,
                               int win, int stride, int pad) {
  const int CV = C / kVec;
  const I total = static_cast<I>(N) * H * W * CV;
  for (I i = blockIdx.x * static_cast<I>(blockDim.x) + threadIdx.x; i < total; i += static_cast<I>(gridDim.x) * blockDim.x) {
    const int4 at = split_index(i, H, W, CV);
    const int n = at.x, h = at.y, w = at.z, cv = at.w;
    const int hp = h + pad, wp = w + pad, self = h * W + w;
    const int p0 = hp < win ? 0 : (hp - win) / stride + 1, p1 = min(P - 1, hp / stride);
    const int q0 = wp < win ? 0 : (wp - win) / stride + 1, q1 = min(Q - 1, wp / stride);
    float sum[kVec] = {};
    for (int p = p0; p <= p1; ++p)
      for (int q = q0; q <= q1; ++q) {
        const I o = ((static_cast<I>(n) * P + p) * Q + q) * C + cv * kVec;
        const int4 a0 = reinterpret_cast<const int4*>(arg + o)[0], a1 = reinterpret_cast<const int4*>(arg + o)[1];
        const int ai[kVec] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
        bool mine = false;
#pragma unroll
        for (int j = 0; j < kVec; ++j) mine |= ai[j] == self;
        if (!mine) continue;
        float g[kVec];
        load8(dy + o, g);
#pragma unroll
        for (int j = 0; j < kVec; ++j)
          if (ai[j] == self) sum[j] += g[j];
      }
    store8(dx + i * kVec, sum);
  }
}

__global__ void k_gap(DPtr x, DPtr y, int N, int HW, int C) {
  GRID_STRIDE(i, static_cast<int64_t>(N) * C) {
    const int64_t n = i / C, c = i % C;
    double s = 0;
    for (int j = 0; j < HW; ++j) s += ld(x.p, x.dt, (n * HW + j) * C + c);
    st(y.mut(), y.dt, i, static_cast<float>(s / HW));
  }
}

__global__ void k_gap_bwd(DPtr dy, DPtr dx, int N, int HW, int C) {
  const float inv = 1.0f / static_cast<float>(HW);
  unrolled(
      static_cast<int64_t>(N) * HW * C,
      [&](int64_t i) {
        const int64_t c = i % C, n = i / (static_cast<int64_t>(HW) * C);
        return ld(dy.p, dy.dt, n * C + c) * inv;
      },
      [&](int64_t i, float v) { st(dx.mut(), dx.dt, i, v); });
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

// ---- softmax cross-entropy --------------------------------------------------------------------

// One block per row: max and first argmax, then the double sum of exponentials.
__global__ void k_xent(DPtr z, const int32_t* labels, DPtr probs, int K, double* row_loss, int* counts) {
  const int row = blockIdx.x;
  const int64_t base = static_cast<int64_t>(row) * K;
  __shared__ float smax[kThreads];
  __shared__ int sarg[kThreads];
  float best = -INFINITY;
  int arg = -1;
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    const float v = ld(z.p, z.dt, base + k);
    if (arg < 0 || v > best) {  // ascending k: keeps the first maximum
      best = v;
      arg = k;
    }
  }
  smax[threadIdx.x] = best;
  sarg[threadIdx.x] = arg;
  __syncthreads();
  for (int o = blockDim.x / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) {
      const float v = smax[threadIdx.x + o];
      const int a = sarg[threadIdx.x + o];
      if (a >= 0 && (sarg[threadIdx.x] < 0 || v > smax[threadIdx.x] || (v == smax[threadIdx.x] && a < sarg[threadIdx.x]))) {
        smax[threadIdx.x] = v;
        sarg[threadIdx.x] = a;
      }
    }
    __syncthreads();
  }
  const float mx = smax[0];
  const int am = sarg[0];
  double s = 0;
  for (int k = threadIdx.x; k < K; k += blockDim.x) s += exp(static_cast<double>(ld(z.p, z.dt, base + k)) - mx);
  s = block_sum(s);
  __shared__ double total;
  if (threadIdx.x == 0) total = s;
  __syncthreads();
  for (int k = threadIdx.x; k < K; k += blockDim.x)
    st(probs.mut(), probs.dt, base + k, static_cast<float>(exp(static_cast<double>(ld(z.p, z.dt, base + k)) - mx) / total));
  if (threadIdx.x == 0) {
    const int lab = labels[row];
    if (lab < 0 || lab >= K) {
      row_loss[row] = 0;
      atomicCAS(counts + 1, 0, row + 1);  // the first bad row found
    } else {
      // Per row, summed in row order afterwards: the loss has the same bits in every run.
      row_loss[row] = log(total) - (static_cast<double>(ld(z.p, z.dt, base + lab)) - mx);
      if (am == lab) atomicAdd(counts, 1);  // integers: any order gives the same count
    }
  }
}

__global__ void k_xent_bwd(DPtr probs, const int32_t* labels, Knob scale_k, DPtr d, int N, int K) {
  const float scale = scale_k.get();
  GRID_STRIDE(i, static_cast<int64_t>(N) * K) {
    const int n = static_cast<int>(i / K), k = static_cast<int>(i % K);
    st(d.mut(), d.dt, i, (ld(probs.p, probs.dt, i) - (k == labels[n] ? 1.f : 0.f)) * scale);
  }
}

}  // namespace

#define LAUNCH(kernel, n, s, ...)                                   \
  do {                                                              \
    if ((n) > 0) {                                                  \
      kernel<<<grid_for(n), kThreads, 0, s>>>(__VA_ARGS__);         \
      check_launch(#kernel);                                        \
    }                                                               \
  } while (0)

// For kernels built on unrolled(): a quarter of the threads, each doing kUnroll elements a round.
#define LAUNCH_UNROLLED(kernel, n, s, ...) LAUNCH(kernel, ((n) + kUnroll - 1) / kUnroll, s, __VA_ARGS__)

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

// Reductions into one address: a bounded grid, whose kReduceBlocks partials one block then adds.
int reduce_grid(int64_t n) { return std::min(grid_for(n), kReduceBlocks); }

void sum_partials(const double* part, int64_t n, double* out, cudaStream_t s) {
  k_sum_partials<<<1, kThreads, 0, s>>>(part, n, out);
  check_launch("k_sum_partials");
}

void sum_squares(const float* x, int64_t n, double* out, double* part, cudaStream_t s) {
  if (n <= 0) {
    REPLICA_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), s));
    return;
  }
  const int blocks = reduce_grid(n);
  k_sum_squares<<<blocks, kThreads, 0, s>>>(x, n, part);
  check_launch("k_sum_squares");
  sum_partials(part, blocks, out, s);
}

void segment_sum_squares(const float* x, const int64_t* offsets, const int64_t* counts, int segments, double* out,
                         cudaStream_t s) {
  if (segments <= 0) return;
  k_segment_sum_squares<<<segments, kThreads, 0, s>>>(x, offsets, counts, out);
  check_launch("k_segment_sum_squares");
}

void sum_in_order(const float* x, int64_t n, float* out, cudaStream_t s) {
  k_sum_in_order<<<1, kThreads, 0, s>>>(x, n, out);
  check_launch("k_sum_in_order");
}

void unscale_check(float* g, int64_t n, Knob inv_scale, int* nonfinite, cudaStream_t s) {
  if (n <= 0) return;
  k_unscale_check<<<reduce_grid(n), kThreads, 0, s>>>(g, n, inv_scale, nonfinite);
  check_launch("k_unscale_check");
}
void unscale_check(float* g, int64_t n, Knob inv_scale, float* nonfinite, cudaStream_t s) {
  if (n <= 0) return;
  k_unscale_check<<<reduce_grid(n), kThreads, 0, s>>>(g, n, inv_scale, nonfinite);
  check_launch("k_unscale_check");
}

// How many leading elements of an update go to the vector kernels: all but the n % 8 tail when
// every buffer is 16-byte aligned and the first flat element a multiple of 8; else none.
int64_t vector_head(int64_t n, int64_t base, DPtr copy, std::initializer_list<const void*> bufs) {
  if (base % kVec != 0 || (copy.p && !aligned16(copy.p))) return 0;
  for (const void* b : bufs)
    if (!aligned16(b)) return 0;
  return n / kVec * kVec;
}
DPtr offset(DPtr d, int64_t i) {
  if (!d.p) return d;
  return {static_cast<const char*>(d.p) + i * (d.dt == 0 ? 4 : 2), d.dt};
}
// Runs launch(copy pointer of type T) with the copy's storage type (none: a null float*).
template <typename Launch>
void with_copy_type(DPtr copy, Launch&& launch) {
  if (!copy.p) launch(static_cast<float*>(nullptr));
  else if (copy.dt == kF16) launch(static_cast<__half*>(copy.mut()));
  else if (copy.dt == kBF16) launch(static_cast<__nv_bfloat16*>(copy.mut()));
  else throw ShapeError("optimizer update: the compute copy must be f16 or bf16");
}

void sgd_update(float* p, const float* g, float* buf, int64_t n, const uint8_t* cls, int64_t base, Knob lr,
                float momentum, float cwd, Knob dwd, bool nesterov, Knob first, DPtr copy, const float* gate,
                cudaStream_t s) {
  const int64_t h = vector_head(n, base, copy, {p, g, buf});
  if (h > 0) {
    with_copy_type(copy, [&](auto* c) {
      k_sgd8<<<grid_for(h / kVec), kThreads, 0, s>>>(p, g, buf, h / kVec, cls, base, lr, momentum, cwd, dwd, nesterov,
                                                     first, c, gate);
    });
    check_launch("k_sgd8");
  }
  LAUNCH(k_sgd, n - h, s, p + h, g + h, buf + h, n - h, cls, base + h, lr, momentum, cwd, dwd, nesterov, first,
         offset(copy, h), gate);
}
void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const uint8_t* cls, int64_t base,
                  float beta1, float beta2, float eps, Knob decay, Knob step_size, Knob inv_sqrt_bc2, DPtr copy,
                  const float* gate, cudaStream_t s) {
  const int64_t h = vector_head(n, base, copy, {p, g, m, v});
  if (h > 0) {
    with_copy_type(copy, [&](auto* c) {
      k_adamw8<<<grid_for(h / kVec), kThreads, 0, s>>>(p, g, m, v, h / kVec, cls, base, beta1, beta2, eps, decay,
                                                       step_size, inv_sqrt_bc2, c, gate);
    });
    check_launch("k_adamw8");
  }
  LAUNCH(k_adamw, n - h, s, p + h, g + h, m + h, v + h, n - h, cls, base + h, beta1, beta2, eps, decay, step_size,
         inv_sqrt_bc2, offset(copy, h), gate);
}
void lars_update(float* p, const float* g, float* buf, int64_t n, const int32_t* cls, int64_t base, Knob lr,
                 const float* ratios, float momentum, float wd, DPtr copy, const float* gate, cudaStream_t s) {
  const int64_t h = vector_head(n, base, copy, {p, g, buf});
  if (h > 0) {
    with_copy_type(copy, [&](auto* c) {
      k_lars8<<<grid_for(h / kVec), kThreads, 0, s>>>(p, g, buf, h / kVec, cls, base, lr, ratios, momentum, wd, c,
                                                      gate);
    });
    check_launch("k_lars8");
  }
  LAUNCH(k_lars, n - h, s, p + h, g + h, buf + h, n - h, cls, base + h, lr, ratios, momentum, wd, offset(copy, h),
         gate);
}
void step_gate(float* stats, int64_t loss, int64_t bad_label, int64_t nonfinite, int64_t grad_squares, int64_t apply,
               int64_t clip, double max_norm, cudaStream_t s) {
  k_step_gate<<<1, 1, 0, s>>>(stats, loss, bad_label, nonfinite, grad_squares, apply, clip, max_norm);
  check_launch("k_step_gate");
}
void scale_by(float* y, int64_t n, const float* factor, cudaStream_t s) { LAUNCH(k_scale_by, n, s, y, n, factor); }
void lars_ratios(const float* w, const float* g, const int64_t* chunk_off, const int64_t* chunk_cnt, int chunks,
                 const int64_t* first, const int64_t* count, int segments, double* part, float trust, float wd,
                 float eps, float* out, cudaStream_t s) {
  if (segments <= 0) return;
  if (chunks > 0) {
    k_lars_chunk_sums<<<chunks, kThreads, 0, s>>>(w, g, chunk_off, chunk_cnt, part);
    check_launch("k_lars_chunk_sums");
  }
  k_lars_ratios<<<(segments + kThreads - 1) / kThreads, kThreads, 0, s>>>(part, first, count, segments, trust, wd, eps,
                                                                         out);
  check_launch("k_lars_ratios");
}

// REPLICA_BN_SUM_GRID=wave: the vector sums take at most one wave of resident blocks (the SMs times
// the backward kernel's occupancy, from the CUDA runtime), each block working through more rows:
// fewer partial sums to write and fold, and no part-empty last wave. At 7x7x2048, batch 256
// (12544 rows, one row lane a block), the default makes 392 blocks, 1.5 waves of an H200's 264
// at 2 a multiprocessor, and 12.8 MB of partials; one wave writes 8.6 MB. The default ("rows",
// about 32 rows a row lane) is the form measured on 2026-12-04 (42-86% of the copy rate) until
// gpu-check has measured both side by side (its kernels-bf16-wave phase). Read once.
bool bn_sum_grid_wave() {
  static const bool wave = [] {
    const char* v = std::getenv("REPLICA_BN_SUM_GRID");
    return v != nullptr && std::string(v) == "wave";
  }();
  return wave;
}
int bn_resident_blocks() {
  static std::atomic<int> cached[64];  // per device index; 0: not yet asked
  int dev = 0;
  REPLICA_CUDA_CHECK(cudaGetDevice(&dev));
  std::atomic<int>& slot = cached[dev & 63];
  if (const int v = slot.load(std::memory_order_relaxed)) return v;
  int sms = 0, per_sm = 0;
  REPLICA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  REPLICA_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_bn_sums8<__nv_bfloat16, true>, kThreads, 0));
  const int v = std::max(1, sms * std::max(1, per_sm));
  slot.store(v, std::memory_order_relaxed);
  return v;
}
// The vector sums' grid: enough blocks for every row lane to have about 32 rows, at most
// kBnSumBlocks (or, with REPLICA_BN_SUM_GRID=wave, one wave of resident blocks).
int bn_sum_blocks(int64_t M, int C) {
  const int64_t lanes = kThreads / std::max(1, C / kVec);
  int64_t blocks = std::clamp<int64_t>((M + lanes * 32 - 1) / (lanes * 32), 1, kBnSumBlocks);
  if (bn_sum_grid_wave()) blocks = std::min<int64_t>(blocks, bn_resident_blocks());
  return static_cast<int>(blocks);
}
// The vector apply passes' grid: at most a few waves, so each thread works through many rows with
// the per-channel coefficients it set up once (a thread per row spent more on that set-up, with
// the backward's double divisions, than on its 48 bytes: 24% of the copy rate, 2026-12-04).
int bn_apply_blocks(int64_t M, int C) {
  return static_cast<int>(std::clamp<int64_t>((M * (C / kVec) + kThreads - 1) / kThreads, 1, 4 * kBnSumBlocks));
}
int64_t bn_partials(int64_t M, int C) {  // doubles of scratch for either form
  if (M <= 0 || C <= 0) return 0;
  return std::max<int64_t>(bn_grid(M, C).y, bn_sum_blocks(M, C)) * 2 * C;
}
void bn_fold_blocks(const double* part, int blocks, int C, double* out1, double* out2, const BnFold& e,
                    cudaStream_t s) {
  k_bn_fold_rows<<<(2 * C + 31) / 32, dim3(32, 32), 0, s>>>(part, blocks, C, out1, out2, e);
  check_launch("k_bn_fold_rows");
}
void bn_fold(const double* part, int rows, int C, double* out1, double* out2, const BnFold& e, cudaStream_t s) {
  LAUNCH(k_bn_fold, C, s, part, rows, C, out1, out2, e);
}
void bn_shifted_moments(DPtr x, int64_t M, int C, const float* shift, double* part, double* acc, cudaStream_t s) {
  const BnFold count{acc + C, static_cast<double>(M)};  // the count between the two sums
  if (M <= 0 || C <= 0) return;
  if (bn_vectors(C, {x})) {
    const int blocks = bn_sum_blocks(M, C);
    with_type(x.dt, [&](auto tag) {
      using T = decltype(tag);
      k_bn_sums8<T, false><<<blocks, kThreads, 0, s>>>(static_cast<const T*>(x.p), nullptr, nullptr, M, C, shift,
                                                       nullptr, part);
    });
    check_launch("k_bn_sums8 (moments)");
    bn_fold_blocks(part, blocks, C, acc, acc + C + 1, count, s);
    return;
  }
  const dim3 grid = bn_grid(M, C);
  k_bn_moments<<<grid, dim3(32, kBnRows), 0, s>>>(x, M, C, shift, part);
  check_launch("k_bn_moments");
  bn_fold(part, static_cast<int>(grid.y), C, acc, acc + C + 1, count, s);
}
void bn_backward_sums(DPtr dy, DPtr relu_y, DPtr x, int64_t M, int C, const float* mean, const float* invstd,
                      double* part, double* acc, const BnFold& e, cudaStream_t s) {
  if (M <= 0 || C <= 0) return;
  if (bn_vectors(C, {dy, relu_y, x})) {
    const int blocks = bn_sum_blocks(M, C);
    with_type(dy.dt, [&](auto tag) {
      using T = decltype(tag);
      k_bn_sums8<T, true><<<blocks, kThreads, 0, s>>>(static_cast<const T*>(dy.p), static_cast<const T*>(relu_y.p),
                                                      static_cast<const T*>(x.p), M, C, mean, invstd, part);
    });
    check_launch("k_bn_sums8 (backward)");
    bn_fold_blocks(part, blocks, C, acc, acc + C, e, s);
    return;
  }
  const dim3 grid = bn_grid(M, C);
  k_bn_bwd_sums<<<grid, dim3(32, kBnRows), 0, s>>>(dy, relu_y, x, M, C, mean, invstd, part);
  check_launch("k_bn_bwd_sums");
  bn_fold(part, static_cast<int>(grid.y), C, acc, acc + C, e, s);
}
void doubles_to_floats(const double* a, float* f, int n, cudaStream_t s) { LAUNCH(k_d2f, n, s, a, f, n); }
void floats_to_doubles(const float* f, double* a, int n, cudaStream_t s) { LAUNCH(k_f2d, n, s, f, a, n); }
void bn_finalize_train(const double* acc, int C, DPtr gamma, DPtr beta, float eps, float momentum, float* save_mean,
                       float* save_invstd, float* running_mean, float* running_var, float* a, float* b,
                       cudaStream_t s) {
  LAUNCH(k_bn_finalize, C, s, acc, C, gamma, beta, eps, momentum, save_mean, save_invstd, running_mean, running_var, a,
         b);
}
void bn_coefficients_eval(DPtr gamma, DPtr beta, const float* running_mean, const float* running_var, float eps, int C,
                          float* a, float* b, cudaStream_t s) {
  LAUNCH(k_bn_coef_eval, C, s, gamma, beta, running_mean, running_var, eps, C, a, b);
}
void bn_apply(DPtr x, DPtr residual, DPtr y, int64_t M, int C, const float* a, const float* b, bool relu,
              cudaStream_t s) {
  if (M <= 0 || C <= 0) return;
  if (bn_vectors(C, {x, residual, y})) {
    with_type(x.dt, [&](auto tag) {
      using T = decltype(tag);
      k_bn_apply8<T><<<bn_apply_blocks(M, C), kThreads, 0, s>>>(
          static_cast<const T*>(x.p), static_cast<const T*>(residual.p), static_cast<T*>(y.mut()), M, C, a, b, relu);
    });
    check_launch("k_bn_apply8");
    return;
  }
  k_bn_apply<<<bn_grid(M, C), dim3(32, kBnRows), 0, s>>>(x, residual, y, M, C, a, b, relu);
  check_launch("k_bn_apply");
}
void bn_backward_apply(DPtr dy, DPtr x, DPtr gamma, const float* mean, const float* invstd, const double* acc, DPtr dx,
                       int64_t M, int C, cudaStream_t s) {
  if (M <= 0 || C <= 0) return;
  if (bn_vectors(C, {dy, x, dx})) {
    with_type(dy.dt, [&](auto tag) {
      using T = decltype(tag);
      k_bn_bwd_apply8<T><<<bn_apply_blocks(M, C), kThreads, 0, s>>>(
          static_cast<const T*>(dy.p), static_cast<const T*>(x.p), gamma, mean, invstd, acc, static_cast<T*>(dx.mut()),
          M, C);
    });
    check_launch("k_bn_bwd_apply8");
    return;
  }
  k_bn_bwd_apply<<<bn_grid(M, C), dim3(32, kBnRows), 0, s>>>(dy, x, gamma, mean, invstd, acc, dx, M, C);
  check_launch("k_bn_bwd_apply");
}

// Whether the 8-channel pooling forms serve these tensors: C a multiple of 8, one dtype, 16-byte aligned.
bool pool_vectors(int C, DPtr a, DPtr b, const int32_t* arg) {
  return C % kVec == 0 && a.dt == b.dt && aligned16(a.p) && aligned16(b.p) && aligned16(arg);
}
void maxpool_forward(DPtr x, DPtr y, int32_t* argmax, int N, int H, int W, int C, int P, int Q, int window, int stride,
                     int pad, cudaStream_t s) {
  const int64_t n = static_cast<int64_t>(N) * H * W * C;  // the larger of input and output
  if (pool_vectors(C, x, y, argmax)) {
    const int64_t v = static_cast<int64_t>(N) * P * Q * (C / kVec);
    if (v <= 0) return;
    with_type(x.dt, [&](auto tag) {
      using T = decltype(tag);
      if (n < (int64_t(1) << 30))
        k_maxpool8<T, int32_t><<<grid_for(v), kThreads, 0, s>>>(static_cast<const T*>(x.p), static_cast<T*>(y.mut()),
                                                                 argmax, N, H, W, C, P, Q, window, stride, pad);
      else
        k_maxpool8<T, int64_t><<<grid_for(v), kThreads, 0, s>>>(static_cast<const T*>(x.p), static_cast<T*>(y.mut()),
                                                                 argmax, N, H, W, C, P, Q, window, stride, pad);
    });
    check_launch("k_maxpool8");
    return;
  }
  if (n < (int64_t(1) << 30)) LAUNCH(k_maxpool<int32_t>, static_cast<int64_t>(N) * P * Q * C, s, x, y, argmax, N, H, W, C, P, Q, window, stride, pad);
  else LAUNCH(k_maxpool<int64_t>, static_cast<int64_t>(N) * P * Q * C, s, x, y, argmax, N, H, W, C, P, Q, window, stride, pad);
}
void maxpool_backward(DPtr dy, const int32_t* argmax, DPtr dx, int N, int H, int W, int C, int P, int Q, int window,
                      int stride, int pad, cudaStream_t s) {
  const int64_t n = static_cast<int64_t>(N) * H * W * C;
  if (pool_vectors(C, dy, dx, argmax)) {
    const int64_t v = n / kVec;
    if (v <= 0) return;
    with_type(dy.dt, [&](auto tag) {
      using T = decltype(tag);
      if (n < (int64_t(1) << 30))
        k_maxpool_bwd8<T, int32_t><<<grid_for(v), kThreads, 0, s>>>(
            static_cast<const T*>(dy.p), argmax, static_cast<T*>(dx.mut()), N, H, W, C, P, Q, window, stride, pad);
      else
        k_maxpool_bwd8<T, int64_t><<<grid_for(v), kThreads, 0, s>>>(
            static_cast<const T*>(dy.p), argmax, static_cast<T*>(dx.mut()), N, H, W, C, P, Q, window, stride, pad);
    });
    check_launch("k_maxpool_bwd8");
    return;
  }
  if (n < (int64_t(1) << 30)) LAUNCH(k_maxpool_bwd<int32_t>, n, s, dy, argmax, dx, N, H, W, C, P, Q, window, stride, pad);
  else LAUNCH(k_maxpool_bwd<int64_t>, n, s, dy, argmax, dx, N, H, W, C, P, Q, window, stride, pad);
}
void global_avgpool_forward(DPtr x, DPtr y, int N, int HW, int C, cudaStream_t s) {
  LAUNCH(k_gap, static_cast<int64_t>(N) * C, s, x, y, N, HW, C);
}
void global_avgpool_backward(DPtr dy, DPtr dx, int N, int HW, int C, cudaStream_t s) {
  LAUNCH_UNROLLED(k_gap_bwd, static_cast<int64_t>(N) * HW * C, s, dy, dx, N, HW, C);
}
void bias_broadcast(DPtr b, DPtr y, int N, int O, cudaStream_t s) {
  LAUNCH(k_bias_broadcast, static_cast<int64_t>(N) * O, s, b, y, N, O);
}
void bias_grad(DPtr dy, float* db, int N, int O, cudaStream_t s) { LAUNCH(k_bias_grad, O, s, dy, db, N, O); }

void softmax_xent_forward(DPtr logits, const int32_t* labels, DPtr probs, int N, int K, double* row_loss,
                          double* result, int* counts, cudaStream_t s) {
  if (N <= 0) {
    REPLICA_CUDA_CHECK(cudaMemsetAsync(result, 0, sizeof(double), s));
    return;
  }
  k_xent<<<N, kThreads, 0, s>>>(logits, labels, probs, K, row_loss, counts);
  check_launch("k_xent");
  sum_partials(row_loss, N, result, s);
}
void xent_fold(const double* result, const int* counts, float* sums, cudaStream_t s) {
  k_xent_fold<<<1, 1, 0, s>>>(result, counts, sums);
  check_launch("k_xent_fold");
}
void softmax_xent_backward(DPtr probs, const int32_t* labels, Knob scale, DPtr dlogits, int N, int K, cudaStream_t s) {
  LAUNCH(k_xent_bwd, static_cast<int64_t>(N) * K, s, probs, labels, scale, dlogits, N, K);
}

}  // namespace replica::ops::cuk
