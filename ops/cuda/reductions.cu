// Deterministic reductions: sums of squares (whole buffers and segments), the in-order sum, and
// the unscale-and-check-finite pass. Every block writes its partial; one pass adds the partials in
// index order, so the same inputs give the same bits in every run (no float atomics).
#include "ops/cuda/kernel_common.cuh"

namespace replica::ops::cuk {
namespace {

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

}  // namespace

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

}  // namespace replica::ops::cuk
