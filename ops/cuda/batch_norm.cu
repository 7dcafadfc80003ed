// Batch norm over [M, C] channels last: the one-pass shifted moments, the finalize (saved and
// running statistics, the apply coefficients), the apply (with a residual and ReLU fused: a
// residual block's join), the backward's sums and apply, the folds of the per-block partials in a
// fixed order, and the f32 <-> f64 conversions around sync-BN's all-reduce. Scalar kernels over
// (pointer, dtype) pairs and 8-channel vector forms where the tensors allow them.
#include <atomic>
#include <cstdlib>
#include <initializer_list>

#include "ops/cuda/kernel_common.cuh"

namespace replica::ops::cuk {
namespace {

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

}  // namespace

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

}  // namespace replica::ops::cuk
