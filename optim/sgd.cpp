// SGD with momentum (PyTorch's form: buf = m * buf + g; Nesterov uses g + m * buf), coupled or
// decoupled weight decay, fused over the flat buffer.
#include "ops/backend.h"
#include "optim/optimizer.h"

namespace replica::optim {

Sgd::Sgd(const nn::ParamRegistry& reg, int64_t total, MemoryPool& pool, SgdOptions o, ShardRange r) : o_(o) {
  set_range(total, r);
  groups_ = clip_groups(make_groups(reg, o.no_decay_bn_bias), lo_, hi_);
  momentum_ = Tensor::zeros(pool, {range_size()}, DType::f32, MemTag::optimizer);
}

void Sgd::update(const Tensor& params, const Tensor& grads, float lr, const Tensor& copy) {
  auto& be = ops::backend_for(params.device());
  for (const auto& grp : groups_) {
    const float wd = grp.decay ? o_.weight_decay : 0.f;
    ops::Backend::SgdUpdate u;
    u.lr = lr;
    u.momentum = o_.momentum;
    u.coupled_wd = o_.decoupled ? 0.f : wd;
    u.decoupled_wd = o_.decoupled ? lr * wd : 0.f;
    u.nesterov = o_.nesterov;
    u.first = steps_ == 0;  // PyTorch starts the buffer at the first gradient
    be.sgd_update(at(params, grp.offset, {grp.count}), at(grads, grp.offset, {grp.count}),
                  momentum_.view(grp.offset - lo_, {grp.count}), u, at_copy(copy, grp.offset, {grp.count}));
  }
  steps_++;
}

}  // namespace replica::optim
