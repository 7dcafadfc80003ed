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
  const MixedLabels lab(labels, N);
  const float* z = logits.data<float>();
  float* pr = probs.data<float>();
  LossResult r;
  for (int64_t n = 0; n < N; ++n) {
    const float* row = z + n * K;
    const int32_t y = lab.label(n), q = lab.weight_q(n);
    if (y < 0 || y >= K)
      throw ShapeError("softmax_cross_entropy: label " + std::to_string(y) + " of sample " +
                       std::to_string(n) + " is outside [0, " + std::to_string(K) + ")");
    if (q < 0 || q > kMixLabelOne)
      throw ShapeError("softmax_cross_entropy: the mixing weight " + std::to_string(q) + " of sample " +
                       std::to_string(n) + " is outside [0, 2^24]");
    const int32_t yb = q == kMixLabelOne ? y : lab.partner_label(n);
    if (yb < 0 || yb >= K)
      throw ShapeError("softmax_cross_entropy: label " + std::to_string(yb) + " of sample " +
                       std::to_string(n ^ 1) + " is outside [0, " + std::to_string(K) + ")");
    const int32_t top = 2 * static_cast<int64_t>(q) >= kMixLabelOne ? y : yb;  // what top-1 / top-5 count
    int64_t arg = 0, above = 0;  // the first maximum; the logits ranked before the counted label's
    for (int64_t k = 1; k < K; ++k)
      if (row[k] > row[arg]) arg = k;
    for (int64_t k = 0; k < K; ++k) above += row[k] > row[top] || (row[k] == row[top] && k < top);
    double mx = row[arg], sum = 0, shifted = 0;
    for (int64_t k = 0; k < K; ++k) {
      sum += std::exp(static_cast<double>(row[k]) - mx);
      shifted += static_cast<double>(row[k]) - mx;
    }
    for (int64_t k = 0; k < K; ++k) pr[n * K + k] = static_cast<float>(std::exp(row[k] - mx) / sum);
    // -sum_k target_k log p_k with target (1 - e) onehot + e / K, log p_k = z_k - mx - log(sum);
    // a mixed row's onehot is w onehot(y) + (1 - w) onehot(yb).
    const double e = smoothing;
    const double own = q == kMixLabelOne ? row[y] - mx
                                         : MixedLabels::weight(q) * (row[y] - mx) +
                                               (1.0 - MixedLabels::weight(q)) * (row[yb] - mx);
    r.loss_sum += std::log(sum) - (1 - e) * own - (e > 0 ? e / K * shifted : 0.0);
    r.correct += arg == top;
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
  const MixedLabels lab(labels, N);
  const float* pr = probs.data<float>();
  float* d = dlogits.data<float>();
  const float on = 1.f - smoothing, off = smoothing / static_cast<float>(K);  // the target's two values
  for (int64_t n = 0; n < N; ++n) {
    const int32_t y = lab.label(n), q = lab.weight_q(n);
    if (q == kMixLabelOne) {
      for (int64_t k = 0; k < K; ++k) d[n * K + k] = (pr[n * K + k] - ((k == y ? on : 0.f) + off)) * scale;
    } else {  // w onehot(y) + (1 - w) onehot(yb), smoothed
      const int32_t yb = lab.partner_label(n);
      const float wa = on * static_cast<float>(MixedLabels::weight(q)), wb = on * (1.f - static_cast<float>(MixedLabels::weight(q)));
      for (int64_t k = 0; k < K; ++k)
        d[n * K + k] = (pr[n * K + k] - ((k == y ? wa : 0.f) + (k == yb ? wb : 0.f) + off)) * scale;
    }
  }
}

}  // namespace replica::ops::REPLICA_CPU_ISA_NS
