// AdamW and LARS over the flat buffers, and clipping by the global gradient norm.
#include <cmath>

#include "core/errors.h"
#include "ops/backend.h"
#include "optim/optimizer.h"

namespace replica::optim {

AdamW::AdamW(const nn::ParamRegistry& reg, int64_t total, MemoryPool& pool, AdamWOptions o, ShardRange r) : o_(o) {
  set_range(total, r);
  classes_ = upload_classes(pool, decay_classes(make_groups(reg, o.no_decay_bn_bias), chunks()));
  m_ = Tensor::zeros(pool, {range_size()}, DType::f32, MemTag::optimizer);
  v_ = Tensor::zeros(pool, {range_size()}, DType::f32, MemTag::optimizer);
  keep_step_values(pool);
}

std::vector<float> AdamW::step_values(float lr) const {
  const double t = static_cast<double>(steps_ + 1);  // this update's step number
  const double bc1 = 1.0 - std::pow(static_cast<double>(o_.beta1), t);
  const double bc2 = 1.0 - std::pow(static_cast<double>(o_.beta2), t);
  // The decaying groups' factor (the table: 1 for the others), the step size, 1 / sqrt(bc2).
  return {1.f - lr * o_.weight_decay, static_cast<float>(lr / bc1), static_cast<float>(1.0 / std::sqrt(bc2))};
}

void AdamW::update(const Tensor& params, const Tensor& grads, float lr, const Tensor& copy, const Tensor& gate) {
  auto& be = backend(params);
  const std::vector<float> sv = step_values(lr);
  ops::Backend::AdamWUpdate u;
  u.beta1 = o_.beta1;
  u.beta2 = o_.beta2;
  u.eps = o_.eps;
  u.decay = step_value(sv, 0, lr);
  u.step_size = step_value(sv, 1, lr);
  u.inv_sqrt_bc2 = step_value(sv, 2, lr);
  u.gate = gate;
  const int64_t n = hi_ - lo_;
  if (n > 0)
    be.adamw_update(in_range(params), in_range(grads), m_.view(0, {n}), v_.view(0, {n}), u, classes_,
                    at_copy(copy, lo_, {n}));
}

Lars::Lars(const nn::ParamRegistry& reg, int64_t total, MemoryPool& pool, LarsOptions o, ShardRange r) : o_(o) {
  set_range(total, r);
  require_chunk_aligned(reg, "lars");
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
  // Each of the range's slots' chunks names its ratio (or -1: a plain step); chunks of other
  // replicas' slots stay -1 (the range holds at most their zero padding).
  std::vector<int32_t> cls(static_cast<size_t>(std::max<int64_t>(chunks(), 1)), -1);
  int32_t k = 0;
  for (const auto& s : slots_) set_chunks<int32_t>(cls, s.offset, s.count, s.adapt ? k++ : -1);
  classes_ = upload_classes(pool, cls);
  keep_step_values(pool);
}

void Lars::update(const Tensor& params, const Tensor& grads, float lr, const Tensor& copy, const Tensor& gate) {
  auto& be = backend(params);
  // Every adapted tensor's trust ratio in one pass, left on the device: the update reads it
  // there, so LARS adds no host synchronisation to the step.
  if (!adapted_.empty())
    be.lars_trust_ratios(in_range(params), in_range(grads), adapted_, o_.trust_coefficient, o_.weight_decay, o_.eps,
                         ratios_);
  // Every slot of the range in one call: the table gives each element its ratio and decay.
  const int64_t n = hi_ - lo_;
  if (n > 0)
    be.lars_update(in_range(params), in_range(grads), momentum_.view(0, {n}), step_value(step_values(lr), 0, lr), ratios_,
                   o_.momentum, o_.weight_decay, classes_, at_copy(copy, lo_, {n}), gate);
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
