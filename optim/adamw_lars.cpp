// AdamW and LARS over the flat buffers, and clipping by the global gradient norm.
#include <cmath>

#include "optim/optimizer.h"

namespace replica::optim {

AdamW::AdamW(const nn::ParamRegistry& reg, int64_t total, MemoryPool& pool, AdamWOptions o)
    : o_(o), groups_(make_groups(reg, o.no_decay_bn_bias)) {
  m_ = Tensor::zeros(pool, {std::max<int64_t>(total, 1)}, DType::f32, MemTag::optimizer);
  v_ = Tensor::zeros(pool, {std::max<int64_t>(total, 1)}, DType::f32, MemTag::optimizer);
}

void AdamW::step(const Tensor& params, const Tensor& grads, float lr) {
  steps_++;
  float* p = params.data<float>();
  const float* g = grads.data<float>();
  float* m = m_.data<float>();
  float* v = v_.data<float>();
  const double bc1 = 1.0 - std::pow(static_cast<double>(o_.beta1), static_cast<double>(steps_));
  const double bc2 = 1.0 - std::pow(static_cast<double>(o_.beta2), static_cast<double>(steps_));
  const float step_size = static_cast<float>(lr / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  for (const auto& grp : groups_) {
    const float decay = grp.decay ? 1.f - lr * o_.weight_decay : 1.f;
    for (int64_t i = grp.offset, e = grp.offset + grp.count; i < e; ++i) {
      p[i] *= decay;
      m[i] = o_.beta1 * m[i] + (1.f - o_.beta1) * g[i];
      v[i] = o_.beta2 * v[i] + (1.f - o_.beta2) * g[i] * g[i];
      p[i] -= step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bc2 + o_.eps);
    }
  }
}

Lars::Lars(const nn::ParamRegistry& reg, int64_t total, MemoryPool& pool, LarsOptions o) : o_(o) {
  for (const auto& s : reg.params())
    slots_.push_back({s.offset, s.shape.numel(), s.kind == nn::ParamKind::weight});
  momentum_ = Tensor::zeros(pool, {std::max<int64_t>(total, 1)}, DType::f32, MemTag::optimizer);
}

void Lars::step(const Tensor& params, const Tensor& grads, float lr) {
  float* p = params.data<float>();
  const float* g = grads.data<float>();
  float* buf = momentum_.data<float>();
  for (const auto& s : slots_) {
    float local = 1.f, wd = 0.f;
    if (s.adapt) {
      double wn = 0, gn = 0;
      for (int64_t i = s.offset; i < s.offset + s.count; ++i) {
        wn += static_cast<double>(p[i]) * p[i];
        gn += static_cast<double>(g[i]) * g[i];
      }
      wn = std::sqrt(wn);
      gn = std::sqrt(gn);
      wd = o_.weight_decay;
      if (wn > 0 && gn > 0) local = static_cast<float>(o_.trust_coefficient * wn / (gn + wd * wn + o_.eps));
    }
    const float scaled = lr * local;
    for (int64_t i = s.offset; i < s.offset + s.count; ++i) {
      buf[i] = o_.momentum * buf[i] + scaled * (g[i] + wd * p[i]);
      p[i] -= buf[i];
    }
  }
  steps_++;
}

double clip_grad_norm(const Tensor& grads, double max_norm) {
  float* g = grads.data<float>();
  double ss = 0;
  for (int64_t i = 0, n = grads.numel(); i < n; ++i) ss += static_cast<double>(g[i]) * g[i];
  const double norm = std::sqrt(ss);
  if (max_norm > 0 && norm > max_norm) {
    const float c = static_cast<float>(max_norm / (norm + 1e-6));
    for (int64_t i = 0, n = grads.numel(); i < n; ++i) g[i] *= c;
  }
  return norm;
}

}  // namespace replica::optim
