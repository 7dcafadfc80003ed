// The CPU loss: softmax cross-entropy over f32 logits, its top-1 and top-5 counts, and the
// gradient against the (label-smoothed) target; one row at a time, summed in double.
#include <cmath>
#include <string>

#include "core/errors.h"
#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/mixed.h"

namespace replica::ops::REPLICA_CPU_ISA_NS {

Backend::LossResult CpuBackend::softmax_xent_forward(const Tensor& logits, const Tensor& labels,
                                                     const Tensor& probs) {
  note_host_sync();
  return xent_rows(logits, labels, probs, 0.f);
}

void CpuBackend::softmax_xent_accumulate(const Tensor& logits, const Tensor& labels, const Tensor& probs,
                                         const Tensor& sums, float smoothing) {
  if (sums.dtype() != DType::f32 || sums.numel() < 3)
    throw ShapeError("softmax_xent_accumulate: sums must be f32 with 3 elements, got " + sums.str());
  const LossResult r = xent_rows(logits, labels, probs, smoothing);  // throws on a bad label
  sums.data<float>()[0] += static_cast<float>(r.loss_sum);
  sums.data<float>()[1] += static_cast<float>(r.correct);
}

Backend::LossResult CpuBackend::xent_rows(const Tensor& logits, const Tensor& labels, const Tensor& probs,
                                          float smoothing) {
  if (LossResult result; run_in_f32({In(logits), Out(probs)}, [&](auto& t) {
        result = xent_rows(t[0], labels, t[1], smoothing);
      }))  // loss in f32
    return result;
  const int64_t N = logits.dim(0), K = logits.dim(1);
  if (labels.numel() != N)
    throw ShapeError("softmax_cross_entropy: " + std::to_string(N) + " rows of logits but " +
                     std::to_string(labels.numel()) + " labels");
  const float* z = logits.data<float>();
  const int32_t* lab = labels.data<int32_t>();
  float* pr = probs.data<float>();
  LossResult r;
  for (int64_t n = 0; n < N; ++n) {
    const float* row = z + n * K;
    const int32_t y = lab[n];
    if (y < 0 || y >= K)
      throw ShapeError("softmax_cross_entropy: label " + std::to_string(y) + " of sample " +
                       std::to_string(n) + " is outside [0, " + std::to_string(K) + ")");
    int64_t arg = 0, above = 0;  // the first maximum; the logits ranked before the label's
    for (int64_t k = 1; k < K; ++k)
      if (row[k] > row[arg]) arg = k;
    for (int64_t k = 0; k < K; ++k) above += row[k] > row[y] || (row[k] == row[y] && k < y);
    double mx = row[arg], sum = 0, shifted = 0;
    for (int64_t k = 0; k < K; ++k) {
      sum += std::exp(static_cast<double>(row[k]) - mx);
      shifted += static_cast<double>(row[k]) - mx;
    }
    for (int64_t k = 0; k < K; ++k) pr[n * K + k] = static_cast<float>(std::exp(row[k] - mx) / sum);
    // -sum_k target_k log p_k with target (1 - e) onehot + e / K, log p_k = z_k - mx - log(sum).
    const double e = smoothing;
    r.loss_sum += std::log(sum) - (1 - e) * (row[y] - mx) - (e > 0 ? e / K * shifted : 0.0);
    r.correct += arg == y;
    r.correct5 += above < 5;
  }
  return r;
}

void CpuBackend::softmax_xent_backward(const Tensor& probs, const Tensor& labels, const StepScalar& step_scale,
                                       const Tensor& dlogits, float smoothing) {
  check_step_scalar(step_scale, dlogits, "softmax_xent_backward");
  const float scale = host_value(step_scale);
  if (run_in_f32({In(probs), Out(dlogits)},
                 [&](auto& t) { softmax_xent_backward(t[0], labels, scale, t[1], smoothing); }))
    return;
  const int64_t N = probs.dim(0), K = probs.dim(1);
  const float* pr = probs.data<float>();
  const int32_t* lab = labels.data<int32_t>();
  float* d = dlogits.data<float>();
  const float on = 1.f - smoothing, off = smoothing / static_cast<float>(K);  // the target's two values
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      d[n * K + k] = (pr[n * K + k] - ((k == lab[n] ? on : 0.f) + off)) * scale;
}

}  // namespace replica::ops::REPLICA_CPU_ISA_NS
