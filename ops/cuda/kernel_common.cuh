// What every kernel file of ops/cuda/ shares: the (pointer, dtype) loads and stores, the launch
// shape and its check, the grid-stride and unrolled loops, 16-byte vector access (PyTorch's
// MemoryAccess.cuh, llm.c's x128), the dtype dispatch, the block sum, and the launch macros.
// Included by .cu files only; everything here has internal linkage, one copy per kernel file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
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

inline int grid_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(std::clamp<int64_t>(b, 1, 1 << 20));  // grid-stride loops cover the rest
}

inline void check_launch(const char* what) {
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

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Runs f with T the C++ type of storage dtype dt (f32, f16 or bf16).
template <typename F>
void with_type(int dt, F&& f) {
  if (dt == kF16) f(__half{});
  else if (dt == kBF16) f(__nv_bfloat16{});
  else f(float{});
}

// Sums v over the block into thread 0's return value.
inline __device__ double block_sum(double v) {
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

}  // namespace replica::ops::cuk
