// RecordingBackend: each CPU backend call runs at once, or goes into the thread's open recording.
#include "ops/recording_backend.h"

#include <tuple>
#include <utility>

#include "core/captured_work.h"
#include "core/errors.h"

namespace replica::ops {

namespace {

// What a recorded call keeps of an argument. Tensors become non-owning views of the same memory:
// a recording holds addresses, as a CUDA graph's nodes do, so the blocks the recorded work
// allocated and freed are free in their pool once it ends (StepGraph checks that), and a replay
// reads and writes them where they were.
Tensor borrow(const Tensor& t) {
  return t.defined() ? Tensor::wrap(t.raw(), t.shape(), t.dtype(), t.device()) : Tensor();
}
StepScalar borrow(const StepScalar& s) { return StepScalar(s.value, borrow(s.at)); }
ChunkClasses borrow(const ChunkClasses& c) { return {borrow(c.table), c.base}; }
Backend::SgdUpdate borrow(const Backend::SgdUpdate& u) {
  Backend::SgdUpdate b = u;
  b.lr = borrow(u.lr);
  b.decoupled_wd = borrow(u.decoupled_wd);
  b.first = borrow(u.first);
  b.gate = borrow(u.gate);
  return b;
}
Backend::AdamWUpdate borrow(const Backend::AdamWUpdate& u) {
  Backend::AdamWUpdate b = u;
  b.decay = borrow(u.decay);
  b.step_size = borrow(u.step_size);
  b.inv_sqrt_bc2 = borrow(u.inv_sqrt_bc2);
  b.gate = borrow(u.gate);
  return b;
}
// A workspace pool: the recorded call's workspace went back to the pool when it returned, and
// those bytes may be another recorded block's by the time of a replay, so a replayed call takes
// its workspace from the replay's pool (core/captured_work.h: capture_work's replay_workspace).
struct ReplayWorkspace {};
ReplayWorkspace borrow(MemoryPool&) { return {}; }
MemoryPool& resolve(const ReplayWorkspace&) {
  MemoryPool* ws = replaying_workspace();
  if (!ws) throw Error("RecordingBackend: a recorded call ran outside a replay");
  return *ws;
}
template <class T>
T borrow(const T& v) {  // numbers, geometries, segment lists, the sync-BN all-reduce
  return v;
}
template <class T>
const T& resolve(const T& v) {
  return v;
}

}  // namespace

template <class Method, class... Args>
void RecordingBackend::call(Method m, Args&&... args) {
  CallRecording* r = call_recording();
  if (!r) {
    (in_.*m)(std::forward<Args>(args)...);
    return;
  }
  r->add([&in = in_, m, kept = std::make_tuple(borrow(args)...)] {
    std::apply([&](const auto&... a) { (in.*m)(resolve(a)...); }, kept);
  });
}

void RecordingBackend::conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& y,
                                      const ConvGeom& g, MemoryPool& ws) {
  call(&Backend::conv2d_forward, x, w, y, g, ws);
}
void RecordingBackend::conv2d_backward_data(const Tensor& dy, const Tensor& w, const Tensor& dx,
                                            const ConvGeom& g, MemoryPool& ws, bool accumulate) {
  call(&Backend::conv2d_backward_data, dy, w, dx, g, ws, accumulate);
}
void RecordingBackend::conv2d_backward_filter(const Tensor& x, const Tensor& dy, const Tensor& dw,
                                              const ConvGeom& g, MemoryPool& ws) {
  call(&Backend::conv2d_backward_filter, x, dy, dw, g, ws);
}
void RecordingBackend::batchnorm_forward_train(const Tensor& x, const Tensor& gamma,
                                               const Tensor& beta, const Tensor& y,
                                               const Tensor& save_mean, const Tensor& save_invstd,
                                               const Tensor& running_mean,
                                               const Tensor& running_var, float momentum, float eps,
                                               const AllReduceFn& allreduce, const Tensor& residual,
                                               bool relu) {
  call(&Backend::batchnorm_forward_train, x, gamma, beta, y, save_mean, save_invstd, running_mean,
       running_var, momentum, eps, allreduce, residual, relu);
}
void RecordingBackend::batchnorm_forward_eval(const Tensor& x, const Tensor& gamma,
                                              const Tensor& beta, const Tensor& y,
                                              const Tensor& running_mean, const Tensor& running_var,
                                              float eps, const Tensor& residual, bool relu) {
  call(&Backend::batchnorm_forward_eval, x, gamma, beta, y, running_mean, running_var, eps,
       residual, relu);
}
void RecordingBackend::batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                          const Tensor& save_mean, const Tensor& save_invstd,
                                          const Tensor& dx, const Tensor& dgamma,
                                          const Tensor& dbeta, const AllReduceFn& allreduce,
                                          const Tensor& relu_y) {
  call(&Backend::batchnorm_backward, dy, x, gamma, save_mean, save_invstd, dx, dgamma, dbeta,
       allreduce, relu_y);
}
void RecordingBackend::batchnorm_backward_frozen(const Tensor& dy, const Tensor& x,
                                                 const Tensor& gamma, const Tensor& mean,
                                                 const Tensor& invstd, const Tensor& dx,
                                                 const Tensor& dgamma, const Tensor& dbeta,
                                                 const Tensor& relu_y) {
  call(&Backend::batchnorm_backward_frozen, dy, x, gamma, mean, invstd, dx, dgamma, dbeta, relu_y);
}
void RecordingBackend::relu_forward(const Tensor& x, const Tensor& y) {
  call(&Backend::relu_forward, x, y);
}
void RecordingBackend::relu_backward(const Tensor& y, const Tensor& dy, const Tensor& dx) {
  call(&Backend::relu_backward, y, dy, dx);
}
void RecordingBackend::add(const Tensor& a, const Tensor& b, const Tensor& y) {
  call(&Backend::add, a, b, y);
}
void RecordingBackend::add_relu(const Tensor& a, const Tensor& b, const Tensor& y) {
  call(&Backend::add_relu, a, b, y);
}
void RecordingBackend::axpy(float alpha, const Tensor& x, const Tensor& y) {
  call(&Backend::axpy, alpha, x, y);
}
void RecordingBackend::fill(const Tensor& y, float value) { call(&Backend::fill, y, value); }
void RecordingBackend::set_values(const Tensor& dst, const float* values, int64_t n) {
  CallRecording* r = call_recording();
  if (!r || n < 0 ||
      n > kMaxSetValues) {  // the inner backend refuses a bad count, recording or not
    in_.set_values(dst, values, n);
    return;
  }
  r->add([&in = in_, d = borrow(dst), v = std::vector<float>(values, values + n)] {
    in.set_values(d, v.data(), static_cast<int64_t>(v.size()));
  });
}
void RecordingBackend::scale(const Tensor& y, float alpha) { call(&Backend::scale, y, alpha); }
void RecordingBackend::scale_by(const Tensor& y, const Tensor& factor) {
  call(&Backend::scale_by, y, factor);
}
void RecordingBackend::maxpool_forward(const Tensor& x, const Tensor& y, const Tensor& argmax,
                                       const PoolGeom& g) {
  call(&Backend::maxpool_forward, x, y, argmax, g);
}
void RecordingBackend::maxpool_backward(const Tensor& dy, const Tensor& argmax, const Tensor& dx,
                                        const PoolGeom& g) {
  call(&Backend::maxpool_backward, dy, argmax, dx, g);
}
void RecordingBackend::global_avgpool_forward(const Tensor& x, const Tensor& y) {
  call(&Backend::global_avgpool_forward, x, y);
}
void RecordingBackend::global_avgpool_backward(const Tensor& dy, const Tensor& dx) {
  call(&Backend::global_avgpool_backward, dy, dx);
}
void RecordingBackend::linear_forward(const Tensor& x, const Tensor& w, const Tensor& b,
                                      const Tensor& y) {
  call(&Backend::linear_forward, x, w, b, y);
}
void RecordingBackend::linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy,
                                       const Tensor& dx, const Tensor& dw, const Tensor& db) {
  call(&Backend::linear_backward, x, w, dy, dx, dw, db);
}
Backend::LossResult RecordingBackend::softmax_xent_forward(const Tensor& logits,
                                                           const Tensor& labels,
                                                           const Tensor& probs) {
  recording_refuses("Backend::softmax_xent_forward");
  return in_.softmax_xent_forward(logits, labels, probs);
}
void RecordingBackend::softmax_xent_accumulate(const Tensor& logits, const Tensor& labels,
                                               const Tensor& probs, const Tensor& sums, float smoothing) {
  call(&Backend::softmax_xent_accumulate, logits, labels, probs, sums, smoothing);
}
void RecordingBackend::softmax_xent_backward(const Tensor& probs, const Tensor& labels,
                                             const StepScalar& scale, const Tensor& dlogits, float smoothing) {
  call(&Backend::softmax_xent_backward, probs, labels, scale, dlogits, smoothing);
}
void RecordingBackend::cast(const Tensor& src, const Tensor& dst) {
  call(&Backend::cast, src, dst);
}
double RecordingBackend::sum_squares(const Tensor& x) {
  recording_refuses("Backend::sum_squares");
  return in_.sum_squares(x);
}
std::vector<double> RecordingBackend::segment_sum_squares(
    const Tensor& x, const std::vector<std::pair<int64_t, int64_t>>& segments) {
  recording_refuses("Backend::segment_sum_squares");
  return in_.segment_sum_squares(x, segments);
}
bool RecordingBackend::unscale_check_finite(const Tensor& grads, float inv_scale) {
  recording_refuses("Backend::unscale_check_finite");
  return in_.unscale_check_finite(grads, inv_scale);
}
void RecordingBackend::sum_squares_into(const Tensor& x, const Tensor& out) {
  call(&Backend::sum_squares_into, x, out);
}
void RecordingBackend::unscale_check_finite_into(const Tensor& grads, const StepScalar& inv_scale,
                                                 const Tensor& nonfinite) {
  call(&Backend::unscale_check_finite_into, grads, inv_scale, nonfinite);
}
void RecordingBackend::segment_sum_squares_into(
    const Tensor& x, const std::vector<std::pair<int64_t, int64_t>>& segments, const Tensor& out) {
  call(&Backend::segment_sum_squares_into, x, segments, out);
}
void RecordingBackend::sum_in_order_into(const Tensor& x, const Tensor& out) {
  call(&Backend::sum_in_order_into, x, out);
}
void RecordingBackend::read_to_host(const Tensor& src, void* dst,
                                    const std::function<void()>& poll) {
  recording_refuses("Backend::read_to_host");
  in_.read_to_host(src, dst, poll);
}
void RecordingBackend::step_gate(const Tensor& s, const StepGateAt& at, double max_norm) {
  call(&Backend::step_gate, s, at, max_norm);
}
void RecordingBackend::rsqrt_eps(const Tensor& x, const Tensor& y, float eps) {
  call(&Backend::rsqrt_eps, x, y, eps);
}
void RecordingBackend::sgd_update(const Tensor& p, const Tensor& g, const Tensor& buf,
                                  const SgdUpdate& u, const ChunkClasses& classes,
                                  const Tensor& copy) {
  call(&Backend::sgd_update, p, g, buf, u, classes, copy);
}
void RecordingBackend::adamw_update(const Tensor& p, const Tensor& g, const Tensor& m,
                                    const Tensor& v, const AdamWUpdate& u,
                                    const ChunkClasses& classes, const Tensor& copy) {
  call(&Backend::adamw_update, p, g, m, v, u, classes, copy);
}
void RecordingBackend::lars_trust_ratios(const Tensor& params, const Tensor& grads,
                                         const std::vector<std::pair<int64_t, int64_t>>& segments,
                                         float trust, float wd, float eps, const Tensor& ratios) {
  call(&Backend::lars_trust_ratios, params, grads, segments, trust, wd, eps, ratios);
}
void RecordingBackend::lars_update(const Tensor& p, const Tensor& g, const Tensor& buf,
                                   const StepScalar& lr, const Tensor& ratios, float momentum,
                                   float wd, const ChunkClasses& classes, const Tensor& copy,
                                   const Tensor& gate) {
  call(&Backend::lars_update, p, g, buf, lr, ratios, momentum, wd, classes, copy, gate);
}

}  // namespace replica::ops
