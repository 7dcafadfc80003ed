// RecordingBackend: the CPU backend as replicas see it. Each call runs at once, as the CPU's work
// always does, unless a CPU recording is open on the thread (core/captured_work.h: a captured
// training step, train.cuda_graph on a CPU replica): then the call is recorded with its arguments
// as they are (the tensors as the memory they name, not as owners of it, so the blocks go back to
// their pool as a CUDA graph's do) and runs on each replay. A call that hands a result to the host
// cannot be recorded and throws, as it fails a CUDA capture.
#pragma once
#include <string>

#include "ops/backend.h"

namespace replica::ops {

class RecordingBackend final : public Backend {
 public:
  explicit RecordingBackend(Backend& inner) : in_(inner) {}
  std::string name() const override { return in_.name(); }
  void set_deterministic(bool on) override { in_.set_deterministic(on); }
  bool deterministic() const override { return in_.deterministic(); }
  uint64_t capture_epoch() const override { return in_.capture_epoch(); }

  void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& y, const ConvGeom& g,
                      MemoryPool& ws) override;
  void conv2d_backward_data(const Tensor& dy, const Tensor& w, const Tensor& dx, const ConvGeom& g,
                            MemoryPool& ws, bool accumulate) override;
  void conv2d_backward_filter(const Tensor& x, const Tensor& dy, const Tensor& dw,
                              const ConvGeom& g, MemoryPool& ws) override;
  void batchnorm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                               const Tensor& y, const Tensor& save_mean, const Tensor& save_invstd,
                               const Tensor& running_mean, const Tensor& running_var,
                               float momentum, float eps, const AllReduceFn& allreduce,
                               const Tensor& residual, bool relu) override;
  void batchnorm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                              const Tensor& y, const Tensor& running_mean,
                              const Tensor& running_var, float eps, const Tensor& residual,
                              bool relu) override;
  void batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                          const Tensor& save_mean, const Tensor& save_invstd, const Tensor& dx,
                          const Tensor& dgamma, const Tensor& dbeta, const AllReduceFn& allreduce,
                          const Tensor& relu_y) override;
  void batchnorm_backward_frozen(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                 const Tensor& mean, const Tensor& invstd, const Tensor& dx,
                                 const Tensor& dgamma, const Tensor& dbeta,
                                 const Tensor& relu_y) override;
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
  std::vector<double> segment_sum_squares(
      const Tensor& x, const std::vector<std::pair<int64_t, int64_t>>& segments) override;
  bool unscale_check_finite(const Tensor& grads, float inv_scale) override;
  void sum_squares_into(const Tensor& x, const Tensor& out) override;
  void unscale_check_finite_into(const Tensor& grads, const StepScalar& inv_scale,
                                 const Tensor& nonfinite) override;
  void segment_sum_squares_into(const Tensor& x,
                                const std::vector<std::pair<int64_t, int64_t>>& segments,
                                const Tensor& out) override;
  void sum_in_order_into(const Tensor& x, const Tensor& out) override;
  void read_to_host(const Tensor& src, void* dst, const std::function<void()>& poll) override;
  void step_gate(const Tensor& s, const StepGateAt& at, double max_norm) override;
  void rsqrt_eps(const Tensor& x, const Tensor& y, float eps) override;
  void sgd_update(const Tensor& p, const Tensor& g, const Tensor& buf, const SgdUpdate& u,
                  const ChunkClasses& classes, const Tensor& copy) override;
  void adamw_update(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v,
                    const AdamWUpdate& u, const ChunkClasses& classes, const Tensor& copy) override;
  void lars_trust_ratios(const Tensor& params, const Tensor& grads,
                         const std::vector<std::pair<int64_t, int64_t>>& segments, float trust,
                         float wd, float eps, const Tensor& ratios) override;
  void lars_update(const Tensor& p, const Tensor& g, const Tensor& buf, const StepScalar& lr,
                   const Tensor& ratios, float momentum, float wd, const ChunkClasses& classes,
                   const Tensor& copy, const Tensor& gate) override;

 private:
  template <class Method, class... Args>
  void call(Method m, Args&&... args);
  Backend& in_;
};

}  // namespace replica::ops
