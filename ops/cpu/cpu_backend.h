// CPU backend: Eigen GEMMs behind im2col on NHWC, plain loops for the rest. One thread per call
// by default (data parallelism puts one replica on each core); parallel.intra_op_threads > 1
// splits a kernel's rows over OpenMP threads (ops/cpu/threads.h), never a sum, so the bits do not
// depend on the thread count.
//
// Compiled once per instruction-set level (ops/CMakeLists.txt's _cpu_kernel_sources: conv.cpp,
// kernels.cpp, loss_kernels.cpp, optim_kernels.cpp, ... with -march=x86-64-v2, -v3, -v4), each copy in its own namespace
// (isa_baseline, isa_avx2, isa_avx512; Eigen renamed the same way), so no inline function of one
// level can stand in for another's at link time; ops/cpu/isa.h chooses one copy at start-up.
#pragma once
#include "core/cpu_features.h"
#include "ops/backend.h"

#ifndef REPLICA_CPU_ISA_NS
#error "ops/cpu kernels are compiled once per instruction-set level: see REPLICA_CPU_VARIANTS in ops/CMakeLists.txt"
#endif

namespace replica::ops::REPLICA_CPU_ISA_NS {

// The level this copy was compiled for, from the compiler's own macros.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
inline constexpr CpuIsa kIsa = CpuIsa::avx512;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline constexpr CpuIsa kIsa = CpuIsa::avx2;
#else
inline constexpr CpuIsa kIsa = CpuIsa::baseline;
#endif

// This copy's backend (one per process) and level: what ops/cpu/isa.cpp's table holds.
Backend& cpu_backend();
CpuIsa cpu_backend_isa();

class CpuBackend : public Backend {
 public:
  std::string name() const override { return "cpu (Eigen)"; }
  void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& y, const ConvGeom& g,
                      MemoryPool& ws) override;
  void conv2d_backward_data(const Tensor& dy, const Tensor& w, const Tensor& dx, const ConvGeom& g,
                            MemoryPool& ws, bool accumulate) override;
  void conv2d_backward_filter(const Tensor& x, const Tensor& dy, const Tensor& dw,
                              const ConvGeom& g, MemoryPool& ws) override;
  void batchnorm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                               const Tensor& y, const Tensor& save_mean, const Tensor& save_invstd,
                               const Tensor& running_mean, const Tensor& running_var,
                               float momentum, float eps, const AllReduceFn& allreduce, const Tensor& residual,
                               bool relu) override;
  void batchnorm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                              const Tensor& y, const Tensor& running_mean,
                              const Tensor& running_var, float eps, const Tensor& residual,
                              bool relu) override;
  void batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                          const Tensor& save_mean, const Tensor& save_invstd, const Tensor& dx,
                          const Tensor& dgamma, const Tensor& dbeta,
                          const AllReduceFn& allreduce, const Tensor& relu_y) override;
  void batchnorm_backward_frozen(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                 const Tensor& mean, const Tensor& invstd, const Tensor& dx,
                                 const Tensor& dgamma, const Tensor& dbeta, const Tensor& relu_y) override;
  void relu_forward(const Tensor& x, const Tensor& y) override;
  void relu_backward(const Tensor& y, const Tensor& dy, const Tensor& dx) override;
  void add(const Tensor& a, const Tensor& b, const Tensor& y) override;
  void add_relu(const Tensor& a, const Tensor& b, const Tensor& y) override;
  void axpy(float alpha, const Tensor& x, const Tensor& y) override;
  void fill(const Tensor& y, float value) override;
  void set_values(const Tensor& dst, const float* values, int64_t n) override;
  void scale(const Tensor& y, float alpha) override;
  void scale_by(const Tensor& y, const Tensor& factor) override;
  void maxpool_forward(const Tensor& x, const Tensor& y, const Tensor& argmax,
                       const PoolGeom& g) override;
  void maxpool_backward(const Tensor& dy, const Tensor& argmax, const Tensor& dx,
                        const PoolGeom& g) override;
  void global_avgpool_forward(const Tensor& x, const Tensor& y) override;
  void global_avgpool_backward(const Tensor& dy, const Tensor& dx) override;
  void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y) override;
  void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                       const Tensor& dw, const Tensor& db) override;
  LossResult softmax_xent_forward(const Tensor& logits, const Tensor& labels,
                                  const Tensor& probs) override;
  void softmax_xent_accumulate(const Tensor& logits, const Tensor& labels, const Tensor& probs,
                               const Tensor& sums, float smoothing) override;
  void softmax_xent_backward(const Tensor& probs, const Tensor& labels, const StepScalar& scale,
                             const Tensor& dlogits, float smoothing) override;
  void cast(const Tensor& src, const Tensor& dst) override;
  double sum_squares(const Tensor& x) override;
  std::vector<double> segment_sum_squares(const Tensor& x,
                                          const std::vector<std::pair<int64_t, int64_t>>& segments) override;
  bool unscale_check_finite(const Tensor& grads, float inv_scale) override;
  void sum_squares_into(const Tensor& x, const Tensor& out) override;
  void segment_sum_squares_into(const Tensor& x, const std::vector<std::pair<int64_t, int64_t>>& segments,
                                const Tensor& out) override;
  void sum_in_order_into(const Tensor& x, const Tensor& out) override;
  void unscale_check_finite_into(const Tensor& grads, const StepScalar& inv_scale, const Tensor& nonfinite) override;
  void read_to_host(const Tensor& src, void* dst, const std::function<void()>& poll) override;
  void rsqrt_eps(const Tensor& x, const Tensor& y, float eps) override;
  void sgd_update(const Tensor& p, const Tensor& g, const Tensor& buf, const SgdUpdate& u,
                  const ChunkClasses& classes, const Tensor& copy) override;
  void adamw_update(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v,
                    const AdamWUpdate& u, const ChunkClasses& classes, const Tensor& copy) override;
  void lars_trust_ratios(const Tensor& params, const Tensor& grads,
                         const std::vector<std::pair<int64_t, int64_t>>& segments, float trust, float wd,
                         float eps, const Tensor& ratios) override;
  void lars_update(const Tensor& p, const Tensor& g, const Tensor& buf, const StepScalar& lr,
                   const Tensor& ratios, float momentum, float wd, const ChunkClasses& classes, const Tensor& copy,
                   const Tensor& gate) override;
  void step_gate(const Tensor& stats, const StepGateAt& at, double max_norm) override;

 private:
  // The bodies of the calls above that return host values; the public calls count a host sync
  // (the CPU has none, but the step is held to the GPU's budget on every backend).
  static LossResult xent_rows(const Tensor& logits, const Tensor& labels, const Tensor& probs, float smoothing);
  static double sum_sq(const Tensor& x);
  static bool unscale_check(const Tensor& grads, float inv_scale);
};

}  // namespace replica::ops::REPLICA_CPU_ISA_NS
