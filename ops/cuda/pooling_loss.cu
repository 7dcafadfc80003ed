// Pooling (max with its argmax, global average) forward and backward, and softmax cross-entropy
// with the fold of its results into the step's sums. Max pooling has 8-channel vector forms where
// the tensors allow them; the loss sums each row in double and the rows in order.
#include "ops/cuda/kernel_common.cuh"

namespace replica::ops::cuk {
namespace {

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

// ---- softmax cross-entropy --------------------------------------------------------------------

// One block per row: max and first argmax, then the double sum of exponentials.
// Labels [N] or mixed [N,2] (Backend::softmax_xent_forward): the row's label, its weight in units
// of 2^-24 and its partner's label (row ^ 1), as the CPU's MixedLabels reads them.
struct RowLabels {
  int a, b, q;
  __device__ RowLabels(const int32_t* labels, bool mixed, int row)
      : a(labels[mixed ? 2 * row : row]), b(a), q(mixed ? labels[2 * row + 1] : kMixOne) {
    if (q != kMixOne) b = labels[2 * (row ^ 1)];
  }
  static constexpr int kMixOne = 1 << 24;
  __device__ bool valid(int K) const { return a >= 0 && a < K && b >= 0 && b < K && q >= 0 && q <= kMixOne; }
  __device__ int counted() const { return 2 * static_cast<int64_t>(q) >= kMixOne ? a : b; }  // top-1 / top-5's
  __device__ double weight() const { return static_cast<double>(q) / kMixOne; }
};

__global__ void k_xent(DPtr z, const int32_t* labels, bool mixed, DPtr probs, int K, float smoothing, double* row_loss,
                       int* counts) {
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
  // The label's rank (the logits before it: larger, or equal at a lower index) for top-5, and with
  // label smoothing the sum of the shifted logits (the uniform part of the target).
  const RowLabels rl(labels, mixed, row);
  const bool valid = rl.valid(K);
  const int lab0 = rl.counted();
  const float zy = valid ? ld(z.p, z.dt, base + lab0) : 0.f;
  double above = 0, shifted = 0;
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    const float v = ld(z.p, z.dt, base + k);
    above += v > zy || (v == zy && k < lab0) ? 1.0 : 0.0;
    if (smoothing > 0.f) shifted += static_cast<double>(v) - mx;
  }
  above = block_sum(above);
  if (smoothing > 0.f) shifted = block_sum(shifted);
  __shared__ double total;
  if (threadIdx.x == 0) total = s;
  __syncthreads();
  for (int k = threadIdx.x; k < K; k += blockDim.x)
    st(probs.mut(), probs.dt, base + k, static_cast<float>(exp(static_cast<double>(ld(z.p, z.dt, base + k)) - mx) / total));
  if (threadIdx.x == 0) {
    const int lab = rl.a;
    if (!valid) {
      row_loss[row] = 0;
      atomicCAS(counts + 1, 0, row + 1);  // the first bad row found
    } else {
      // Per row, summed in row order afterwards: the loss has the same bits in every run. Against
      // the target (1 - e) onehot + e / K (ops/cpu/kernels.cpp's formula).
      // A mixed row's onehot is w onehot(a) + (1 - w) onehot(b).
      const double e = smoothing;
      const double own = rl.q == RowLabels::kMixOne
                             ? static_cast<double>(ld(z.p, z.dt, base + lab)) - mx
                             : rl.weight() * (static_cast<double>(ld(z.p, z.dt, base + lab)) - mx) +
                                   (1.0 - rl.weight()) * (static_cast<double>(ld(z.p, z.dt, base + rl.b)) - mx);
      row_loss[row] = log(total) - (1 - e) * own - (e > 0 ? e / K * shifted : 0.0);
      if (am == lab0) atomicAdd(counts, 1);  // integers: any order gives the same count
      if (above < 5) atomicAdd(counts + 2, 1);
    }
  }
}

__global__ void k_xent_bwd(DPtr probs, const int32_t* labels, bool mixed, Knob scale_k, float smoothing, DPtr d, int N,
                           int K) {
  const float scale = scale_k.get();
  const float on = 1.f - smoothing, off = smoothing / static_cast<float>(K);  // the target's two values
  GRID_STRIDE(i, static_cast<int64_t>(N) * K) {
    const int n = static_cast<int>(i / K), k = static_cast<int>(i % K);
    const RowLabels rl(labels, mixed, n);
    float target;
    if (rl.q == RowLabels::kMixOne) {
      target = (k == rl.a ? on : 0.f) + off;
    } else {
      const float w = static_cast<float>(rl.weight());
      target = (k == rl.a ? on * w : 0.f) + (k == rl.b ? on * (1.f - w) : 0.f) + off;
    }
    st(d.mut(), d.dt, i, (ld(probs.p, probs.dt, i) - target) * scale);
  }
}

// Folds one loss kernel's results into the step's f32 sums (the step reads them once).
__global__ void k_xent_fold(const double* result, const int* counts, float* sums) {
  sums[0] += static_cast<float>(*result);
  sums[1] += static_cast<float>(counts[0]);
  if (counts[1]) sums[2] += 1.f;
}

}  // namespace

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

void softmax_xent_forward(DPtr logits, const int32_t* labels, bool mixed, DPtr probs, int N, int K, float smoothing,
                          double* row_loss, double* result, int* counts, cudaStream_t s) {
  if (N <= 0) {
    REPLICA_CUDA_CHECK(cudaMemsetAsync(result, 0, sizeof(double), s));
    return;
  }
  k_xent<<<N, kThreads, 0, s>>>(logits, labels, mixed, probs, K, smoothing, row_loss, counts);
  check_launch("k_xent");
  sum_partials(row_loss, N, result, s);
}
void xent_fold(const double* result, const int* counts, float* sums, cudaStream_t s) {
  k_xent_fold<<<1, 1, 0, s>>>(result, counts, sums);
  check_launch("k_xent_fold");
}
void softmax_xent_backward(DPtr probs, const int32_t* labels, bool mixed, Knob scale, float smoothing, DPtr dlogits,
                           int N, int K, cudaStream_t s) {
  LAUNCH(k_xent_bwd, static_cast<int64_t>(N) * K, s, probs, labels, mixed, scale, smoothing, dlogits, N, K);
}

}  // namespace replica::ops::cuk
