// The CUDA backend's batch norm: training and evaluation forward (with a residual and ReLU fused),
// backward with batch or frozen statistics, and sync-BN's one reduction of the sums between the
// kernels of batch_norm.cu.
#include "ops/cuda/cuda_backend_impl.h"

namespace replica::ops::cuda_impl {

void CudaBackend::batchnorm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y,
                             const Tensor& save_mean, const Tensor& save_invstd, const Tensor& running_mean,
                             const Tensor& running_var, float momentum, float eps, const AllReduceFn& allreduce,
                             const Tensor& residual, bool relu) {
  const int C = channels(x);
  const int64_t M = x.numel() / C;
  auto& ts = state();
  cudaStream_t s = stream();
  // scratch: acc[2C + 1] doubles (shifted sums, count, shifted squares) | f[2C + 1] floats for
  // the sync-BN reduction | a[C] | b[C] | the per-block partial sums (kernels.h, bn_partials)
  const size_t head = align_up((2 * C + 1) * sizeof(double) + (4 * C + 1) * sizeof(float));
  char* base = static_cast<char*>(ts.get_scratch(head + cuk::bn_partials(M, C) * sizeof(double)));
  double* acc = reinterpret_cast<double*>(base);
  float* f = reinterpret_cast<float*>(acc + 2 * C + 1);
  float* a = f + 2 * C + 1;
  float* b = a + C;
  double* part = reinterpret_cast<double*>(base + head);
  // One pass for both moments, shifted by the running mean (identical on every replica under
  // sync-BN: all of them update it from the same global statistics), or by 0 where the running
  // mean is not finite (kernels.cu, bn_shift).
  cuk::bn_shifted_moments(dp(x), M, C, running_mean.data<float>(), part, acc, s);  // and acc[C] = M
  reduce(acc, f, 2 * C + 1, allreduce, s);  // one reduction for sums, count and squares
  cuk::bn_finalize_train(acc, C, dp(gamma), dp(beta), eps, momentum, save_mean.data<float>(),
                         save_invstd.data<float>(), running_mean.data<float>(), running_var.data<float>(), a, b, s);
  cuk::bn_apply(dp(x), residual_of(x, residual), dp(y), M, C, a, b, relu, s);
}

void CudaBackend::batchnorm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y,
                            const Tensor& running_mean, const Tensor& running_var, float eps, const Tensor& residual,
                            bool relu) {
  const int C = channels(x);
  const cuk::DPtr res = residual_of(x, residual);
  auto& ts = state();
  float* a = static_cast<float*>(ts.get_scratch(2 * C * sizeof(float)));
  cuk::bn_coefficients_eval(dp(gamma), dp(beta), running_mean.data<float>(), running_var.data<float>(), eps, C, a,
                            a + C, stream());
  cuk::bn_apply(dp(x), res, dp(y), x.numel() / C, C, a, a + C, relu, stream());
}

void CudaBackend::batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                        const Tensor& save_invstd, const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta,
                        const AllReduceFn& allreduce, const Tensor& relu_y) {
  const int C = channels(x);
  const int64_t M = x.numel() / C;
  auto& ts = state();
  cudaStream_t s = stream();
  const cuk::DPtr ry = relu_y.defined() ? dp(relu_y) : cuk::DPtr{};  // the fused ReLU's mask: dy masked in place
  // scratch: acc[2C + 1] (sum dy, sum dy * xhat, count) doubles | f[2C + 1] floats | partials
  const size_t head = align_up((2 * C + 1) * (sizeof(double) + sizeof(float)));
  char* base = static_cast<char*>(ts.get_scratch(head + cuk::bn_partials(M, C) * sizeof(double)));
  double* acc = reinterpret_cast<double*>(base);
  float* f = reinterpret_cast<float*>(acc + 2 * C + 1);
  double* part = reinterpret_cast<double*>(base + head);
  // The fold also adds the local sums into dbeta / dgamma and stores the count acc[2C].
  const cuk::BnFold fold{acc + 2 * C, static_cast<double>(M), dbeta.data<float>(), dgamma.data<float>()};
  cuk::bn_backward_sums(dp(dy), ry, dp(x), M, C, save_mean.data<float>(), save_invstd.data<float>(), part, acc, fold,
                        s);
  reduce(acc, f, 2 * C + 1, allreduce, s);  // sync-BN: dx needs the sums over the global batch
  cuk::bn_backward_apply(dp(dy), dp(x), dp(gamma), save_mean.data<float>(), save_invstd.data<float>(), acc, dp(dx),
                         M, C, s);
}

void CudaBackend::batchnorm_backward_frozen(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                               const Tensor& invstd, const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta,
                               const Tensor& relu_y) {
  const int C = channels(x);
  const int64_t M = x.numel() / C;
  auto& ts = state();
  cudaStream_t s = stream();
  const cuk::DPtr ry = relu_y.defined() ? dp(relu_y) : cuk::DPtr{};
  const size_t head = align_up(2 * C * sizeof(double));
  char* base = static_cast<char*>(ts.get_scratch(head + cuk::bn_partials(M, C) * sizeof(double)));
  double* acc = reinterpret_cast<double*>(base);
  const cuk::BnFold fold{nullptr, 0, dbeta.data<float>(), dgamma.data<float>()};
  cuk::bn_backward_sums(dp(dy), ry, dp(x), M, C, mean.data<float>(), invstd.data<float>(),
                        reinterpret_cast<double*>(base + head), acc, fold, s);
  cuk::bn_backward_apply(dp(dy), dp(x), dp(gamma), mean.data<float>(), invstd.data<float>(), nullptr, dp(dx), M, C,
                         s);
}

// A batch norm's fused residual (undefined: none), checked against its input.
cuk::DPtr CudaBackend::residual_of(const Tensor& x, const Tensor& residual) {
  if (!residual.defined()) return {};
  require_float(residual, "batchnorm (residual)");
  require_same(x, residual, "batchnorm (residual)");
  return dp(residual);
}

int CudaBackend::channels(const Tensor& x) {
  require_float(x, "batchnorm");
  return as_int(x.shape()[x.shape().rank() - 1], "batchnorm");
}

// Sums `n` device doubles across replicas: through floats (the CPU backend's convention), in place.
void CudaBackend::reduce(double* acc, float* f, int n, const AllReduceFn& allreduce, cudaStream_t s) {
  if (!allreduce) return;
  cuk::doubles_to_floats(acc, f, n, s);
  // Replica::psum_on_stream: NCCL on the latency lane, after this stream's work, and this
  // stream waits for it on the device (no host round trip).
  allreduce(f, static_cast<size_t>(n));
  cuk::floats_to_doubles(f, acc, n, s);
}

}  // namespace replica::ops::cuda_impl
