// SGD with momentum (PyTorch's form: buf = m * buf + g; Nesterov uses g + m * buf), coupled or
// decoupled weight decay, fused over the flat buffer.
#include "ops/backend.h"
#include "optim/optimizer.h"

namespace replica::optim {

Sgd::Sgd(const nn::ParamRegistry& reg, int64_t total, MemoryPool& pool, SgdOptions o, ShardRange r) : o_(o) {
  set_range(total, r);
  classes_ = upload_classes(pool, decay_classes(make_groups(reg, o.no_decay_bn_bias), chunks()));
  momentum_ = Tensor::zeros(pool, {range_size()}, DType::f32, MemTag::optimizer);
  keep_step_values(pool);
}

// The learning rate, the decoupled decay, and 1 on the first step (PyTorch starts the momentum
// buffer at the first gradient).
std::vector<float> Sgd::step_values(float lr) const {
  return {lr, o_.decoupled ? lr * o_.weight_decay : 0.f, steps_ == 0 ? 1.f : 0.f};
}

// Every group of the range in one call: the table gives each element its decay.
void Sgd::update(const Tensor& params, const Tensor& grads, float lr, const Tensor& copy, const Tensor& gate) {
  const int64_t n = hi_ - lo_;
  if (n > 0) {
    const std::vector<float> v = step_values(lr);
    ops::Backend::SgdUpdate u;
    u.lr = step_value(v, 0, lr);
    u.decoupled_wd = step_value(v, 1, lr);
    u.first = step_value(v, 2, lr);
    u.momentum = o_.momentum;
    u.coupled_wd = o_.decoupled ? 0.f : o_.weight_decay;
    u.nesterov = o_.nesterov;
    u.gate = gate;
    backend(params)
        .sgd_update(in_range(params), in_range(grads), momentum_.view(0, {n}), u, classes_, at_copy(copy, lo_, {n}));
  }
}

}  // namespace replica::optim
