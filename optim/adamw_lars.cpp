// AdamW and LARS over the flat buffers, and clipping by the global gradient norm.
#include <cmath>

#include "core/errors.h"
#include "ops/backend.h"
#include "optim/optimizer.h"

namespace replica::optim {

AdamW::AdamW(const nn::ParamRegistry& reg, int64_t total, MemoryPool& pool, AdamWOptions o, ShardRange r) : o_(o) {
  set_range(total, r);
  groups_ = clip_groups(make_groups(reg, o.no_decay_bn_bias), lo_, hi_);
  m_ = Tensor::zeros(pool, {range_size()}, DType::f32, MemTag::optimizer);
  v_ = Tensor::zeros(pool, {range_size()}, DType::f32, MemTag::optimizer);
}

void AdamW::update(const Tensor& params, const Tensor& grads, float lr, const Tensor& copy) {
  steps_++;
  auto& be = ops::backend_for(params.device());
  const double bc1 = 1.0 - std::pow(static_cast<double>(o_.beta1), static_cast<double>(steps_));
  const double bc2 = 1.0 - std::pow(static_cast<double>(o_.beta2), static_cast<double>(steps_));
  ops::Backend::AdamWUpdate u;
  u.beta1 = o_.beta1;
  u.beta2 = o_.beta2;
  u.eps = o_.eps;
  u.step_size = static_cast<float>(lr / bc1);
  u.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  for (const auto& grp : groups_) {
    u.decay = grp.decay ? 1.f - lr * o_.weight_decay : 1.f;
    Shape s{grp.count};
    be.adamw_update(at(params, grp.offset, s), at(grads, grp.offset, s), m_.view(grp.offset - lo_, s),
                    v_.view(grp.offset - lo_, s), u, at_copy(copy, grp.offset, s));
  }
}

Lars::Lars(const nn::ParamRegistry& reg, int64_t total, MemoryPool& pool, LarsOptions o, ShardRange r) : o_(o) {
  set_range(total, r);
  for (const auto& s : reg.params()) {
    const int64_t n = s.shape.numel();
    if (s.offset + n <= lo_ || s.offset >= hi_) continue;  // another replica's
    if (s.offset < lo_ || s.offset + n > hi_)
      throw Error("lars: shard range [" + std::to_string(lo_) + ", " + std::to_string(hi_) + ") splits the tensor at [" +
                  std::to_string(s.offset) + ", " + std::to_string(s.offset + n) +
                  "); LARS shards are cut on tensor edges (its trust ratio needs the whole tensor's norms)");
    slots_.push_back({s.offset, n, s.kind == nn::ParamKind::weight});
  }
  momentum_ = Tensor::zeros(pool, {range_size()}, DType::f32, MemTag::optimizer);
  for (const auto& s : slots_)  // from the range's start: the ratios read the range alone
    if (s.adapt) adapted_.emplace_back(s.offset - lo_, s.count);
  ratios_ = Tensor::zeros(pool, {std::max<int64_t>(static_cast<int64_t>(adapted_.size()), 1)}, DType::f32,
                          MemTag::optimizer);
}

void Lars::update(const Tensor& params, const Tensor& grads, float lr, const Tensor& copy) {
  auto& be = ops::backend_for(params.device());
  // Every adapted tensor's trust ratio in one pass, left on the device: the update reads it
  // there, so LARS adds no host synchronisation to the step.
  if (!adapted_.empty())
    be.lars_trust_ratios(in_range(params), in_range(grads), adapted_, o_.trust_coefficient, o_.weight_decay, o_.eps,
                         ratios_);
  int64_t k = 0;
  for (const auto& s : slots_) {
    Shape sh{s.count};
    const Tensor ratio = s.adapt ? ratios_.view(k++, {1}) : Tensor();
    be.lars_update(at(params, s.offset, sh), at(grads, s.offset, sh), momentum_.view(s.offset - lo_, sh), lr, ratio,
                   o_.momentum, s.adapt ? o_.weight_decay : 0.f, at_copy(copy, s.offset, sh));
  }
  steps_++;
}

double clip_grad_norm(const Tensor& grads, double max_norm) {
  auto& be = ops::backend_for(grads.device());
  const double norm = std::sqrt(be.sum_squares(grads));
  clip_grad_norm(grads, max_norm, norm);
  return norm;
}

void clip_grad_norm(const Tensor& grads, double max_norm, double norm) {
  if (max_norm > 0 && norm > max_norm)
    ops::backend_for(grads.device()).scale(grads, static_cast<float>(max_norm / (norm + 1e-6)));
}

}  // namespace replica::optim
