// Launchers for the hand-written CUDA kernels of the op backend (ops/cuda/*.cu, a file per
// concern: elementwise, reductions, optimizers, batch_norm, pooling_loss). Tensors travel as
// (pointer, dtype) pairs so one kernel serves f32, f16 and bf16 storage: every kernel loads into
// f32, computes in f32 (reductions in double where the CPU backend uses double) and rounds once on
// store, as the CPU backend does.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#ifdef __CUDACC__
#define REPLICA_HOST_DEVICE __host__ __device__
#else
#define REPLICA_HOST_DEVICE
#endif

namespace replica::ops::cuk {

// dtype codes: the values of replica::DType (f32 = 0, f16 = 1, bf16 = 2).
struct DPtr {
  const void* p = nullptr;
  int dt = 0;
  REPLICA_HOST_DEVICE void* mut() const { return const_cast<void*>(p); }
};

// A value that changes from step to step (ops::StepScalar): `v`, or *at when at is set, read by
// the kernel when it runs (a CUDA graph replays the step's calls with the values written there).
struct Knob {
  float v = 0;
  const float* at = nullptr;
#ifdef __CUDACC__
  __device__ float get() const { return at ? *at : v; }
#endif
};

// y[0, n) = values (n <= 64), passed as the kernel's arguments: no host buffer outlives the call.
void set_values(float* y, const float* values, int n, cudaStream_t s);

// Elementwise over n elements.
void cast(DPtr src, DPtr dst, int64_t n, cudaStream_t s);
void relu_forward(DPtr x, DPtr y, int64_t n, cudaStream_t s);
void relu_backward(DPtr y, DPtr dy, DPtr dx, int64_t n, cudaStream_t s);
void add(DPtr a, DPtr b, DPtr y, int64_t n, cudaStream_t s);
void add_relu(DPtr a, DPtr b, DPtr y, int64_t n, cudaStream_t s);  // y = max(a + b, 0)
void axpy(float alpha, DPtr x, DPtr y, int64_t n, cudaStream_t s);  // y += alpha * x
void fill(DPtr y, float v, int64_t n, cudaStream_t s);
void scale(DPtr y, float alpha, int64_t n, cudaStream_t s);
void rsqrt_eps(const float* x, float* y, float eps, int64_t n, cudaStream_t s);

// Reductions into device doubles, deterministic: per-block partials (`part`: kReduceBlocks
// doubles of scratch) added in a fixed order, never atomics.
constexpr int kReduceBlocks = 2048;
void sum_squares(const float* x, int64_t n, double* out, double* part, cudaStream_t s);
// *out = the sum of part[0, n) in a fixed order (one block).
void sum_partials(const double* part, int64_t n, double* out, cudaStream_t s);
// out[i] = sum of squares of x[offsets[i], offsets[i] + counts[i]); offsets/counts in device memory.
void segment_sum_squares(const float* x, const int64_t* offsets, const int64_t* counts, int segments,
                         double* out, cudaStream_t s);
// *out = the sum of x in index order (double, rounded to f32): one thread, deterministic.
void sum_in_order(const float* x, int64_t n, float* out, cudaStream_t s);
// g *= inv_scale; *nonfinite set to 1 if any element was inf or NaN (caller zeroes it).
void unscale_check(float* g, int64_t n, Knob inv_scale, int* nonfinite, cudaStream_t s);
void unscale_check(float* g, int64_t n, Knob inv_scale, float* nonfinite, cudaStream_t s);  // sets 1.f

// Optimizers (f32 flat buffers); formulas as in ops/cpu/optim_kernels.cpp. `copy` (p null: none):
// the 16-bit compute copy, written with each updated parameter rounded as cast() rounds it.
// `cls`: the parameter groups' table (ops::ChunkClasses), entry (base + i) >> kChunkShift for
// element i; sgd/adamw: null = every element decays.
constexpr int kChunkShift = 4;  // ops::kParamChunk = 16 elements per entry
// `gate` (null: none): 0 at run time leaves everything as it was (Backend::step_gate's verdict).
// The Knobs are the values that change from step to step (sgd's first: nonzero on the first step).
void sgd_update(float* p, const float* g, float* buf, int64_t n, const uint8_t* cls, int64_t base, Knob lr,
                float momentum, float cwd, Knob dwd, bool nesterov, Knob first, DPtr copy, const float* gate,
                cudaStream_t s);
void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const uint8_t* cls, int64_t base,
                  float beta1, float beta2, float eps, Knob decay, Knob step_size, Knob inv_sqrt_bc2, DPtr copy,
                  const float* gate, cudaStream_t s);
// class k >= 0: lr * ratios[k] and wd; -1: lr, no decay.
void lars_update(float* p, const float* g, float* buf, int64_t n, const int32_t* cls, int64_t base, Knob lr,
                 const float* ratios, float momentum, float wd, DPtr copy, const float* gate, cudaStream_t s);
// Backend::step_gate over the f32 scalars `stats` (indices into it), one thread.
void step_gate(float* stats, int64_t loss, int64_t bad_label, int64_t nonfinite, int64_t grad_squares, int64_t apply,
               int64_t clip, double max_norm, cudaStream_t s);
void scale_by(float* y, int64_t n, const float* factor, cudaStream_t s);  // y *= *factor (f32)
// out[i] = LARS trust ratio of segment i, as the CPU backend: the segments cut into chunks
// (chunk_off/chunk_cnt, device memory) whose squared norms go to part (2 doubles a chunk), then
// segment i adds chunks [first[i], first[i] + count[i]) in order.
constexpr int64_t kLarsChunk = 16384;
void lars_ratios(const float* w, const float* g, const int64_t* chunk_off, const int64_t* chunk_cnt, int chunks,
                 const int64_t* first, const int64_t* count, int segments, double* part, float trust, float wd,
                 float eps, float* out, cudaStream_t s);

// Batch norm over [M, C] (channels last). Scratch layout is the caller's (see cuda_backend.cpp).
// One pass over x for both moments, shifted by shift[c] (the running mean: close to the batch
// mean, so the variance does not cancel catastrophically): acc[c] = sum x - K, acc[C + 1 + c] =
// sum (x - K)^2.
// The sums are deterministic: per-block partials into `part` (bn_partials(M, C) doubles of
// scratch), added in a fixed order into acc (acc = the sums, not +=).
int64_t bn_partials(int64_t M, int C);
// What the kernel that folds the partials also does, instead of launches of their own: store the
// row count (*count_at = count, for the statistics' all-reduce and finalize) and add the two sums,
// rounded to f32, into add1 / add2 (batch norm's dbeta / dgamma += the local sums). Null: nothing.
struct BnFold {
  double* count_at = nullptr;
  double count = 0;
  float* add1 = nullptr;
  float* add2 = nullptr;
};
// acc[C] = M, the count (the fold stores it).
void bn_shifted_moments(DPtr x, int64_t M, int C, const float* shift, double* part, double* acc,
                        cudaStream_t s);
// acc[c] = sum g; acc[C + c] = sum g * (x - mean[c]) * invstd[c] with g = dy, masked by relu_y > 0
// when relu_y.p is set (a fused ReLU): the masked g is then written back to dy, in place (what the
// apply pass and a residual block's shortcut read); `part` as above.
void bn_backward_sums(DPtr dy, DPtr relu_y, DPtr x, int64_t M, int C, const float* mean,
                      const float* invstd, double* part, double* acc, const BnFold& fold, cudaStream_t s);
void doubles_to_floats(const double* a, float* f, int n, cudaStream_t s);
void floats_to_doubles(const float* f, double* a, int n, cudaStream_t s);
// From the shifted moments and the count acc[C]: saved mean/invstd, running stats (the shift is
// read before they move), and the y = x * a + b coefficients.
void bn_finalize_train(const double* acc, int C, DPtr gamma, DPtr beta, float eps, float momentum,
                       float* save_mean, float* save_invstd, float* running_mean, float* running_var,
                       float* a, float* b, cudaStream_t s);
void bn_coefficients_eval(DPtr gamma, DPtr beta, const float* running_mean, const float* running_var,
                          float eps, int C, float* a, float* b, cudaStream_t s);
// y = x * a + b (+ residual, when residual.p is set), then max(., 0) when relu.
void bn_apply(DPtr x, DPtr residual, DPtr y, int64_t M, int C, const float* a, const float* b, bool relu,
              cudaStream_t s);
// dx = gamma * invstd * (dy - m1 - xhat * m2), m1/m2 = acc sums over the count acc[2C]; frozen
// (acc == null): dx = gamma * invstd * dy. dy as bn_backward_sums left it (masked).
void bn_backward_apply(DPtr dy, DPtr x, DPtr gamma, const float* mean, const float* invstd,
                       const double* acc, DPtr dx, int64_t M, int C, cudaStream_t s);

// Pooling (NHWC).
void maxpool_forward(DPtr x, DPtr y, int32_t* argmax, int N, int H, int W, int C, int P, int Q,
                     int window, int stride, int pad, cudaStream_t s);
void maxpool_backward(DPtr dy, const int32_t* argmax, DPtr dx, int N, int H, int W, int C, int P,
                      int Q, int window, int stride, int pad, cudaStream_t s);
void global_avgpool_forward(DPtr x, DPtr y, int N, int HW, int C, cudaStream_t s);
void global_avgpool_backward(DPtr dy, DPtr dx, int N, int HW, int C, cudaStream_t s);

// Linear helpers: y[n, o] = b[o] (before a GEMM with beta = 1); db[o] += sum_n dy[n, o].
void bias_broadcast(DPtr b, DPtr y, int N, int O, cudaStream_t s);
void bias_grad(DPtr dy, float* db, int N, int O, cudaStream_t s);

// Softmax cross-entropy over [N, K] logits against (1 - smoothing) onehot + smoothing / K.
// result[0] = summed loss (double; the rows' losses go to row_loss[N] and are added in row order:
// the same bits every run), counts[0] += correct argmax predictions, counts[1] = index + 1 of a row
// whose label is outside [0, K) (0: none), counts[2] += rows whose label is among the 5 largest
// logits (ties: the lower index first). The caller zeroes counts. `mixed`: labels are [N, 2] pairs
// (label, weight in units of 2^-24) mixed with row n ^ 1 (Backend::softmax_xent_forward).
void softmax_xent_forward(DPtr logits, const int32_t* labels, bool mixed, DPtr probs, int N, int K, float smoothing,
                          double* row_loss, double* result, int* counts, cudaStream_t s);
// sums[0] += result[0], sums[1] += counts[0], sums[2] += 1 if counts[1] (one thread, on-stream).
void xent_fold(const double* result, const int* counts, float* sums, cudaStream_t s);
// dlogits = (probs - target) * scale, the target as above.
void softmax_xent_backward(DPtr probs, const int32_t* labels, bool mixed, Knob scale, float smoothing, DPtr dlogits,
                           int N, int K, cudaStream_t s);

}  // namespace replica::ops::cuk
