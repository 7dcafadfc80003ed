// SGD with momentum (PyTorch's form: buf = m * buf + g; Nesterov uses g + m * buf), coupled or
// decoupled weight decay, fused over the flat buffer.
#include "ops/backend.h"
#include "optim/optimizer.h"

namespace replica::optim {

Sgd::Sgd(const nn::ParamRegistry& reg, int64_t total, MemoryPool& pool, SgdOptions o, ShardRange r) : o_(o) {
  set_range(total, r);
  classes_ = upload_classes(pool, decay_classes(make_groups(reg, o.no_decay_bn_bias), chunks()));
  momentum_ = Tensor::zeros(pool, {range_size()}, DType::f32, MemTag::optimizer);
}

// Every group of the range in one call: the table gives each element its decay.
void Sgd::update(const Tensor& params, const Tensor& grads, float lr, const Tensor& copy, const Tensor& gate) {
  const int64_t n = hi_ - lo_;
  if (n > 0) {
    ops::Backend::SgdUpdate u;
    u.lr = lr;
    u.momentum = o_.momentum;
    u.coupled_wd = o_.decoupled ? 0.f : o_.weight_decay;
    u.decoupled_wd = o_.decoupled ? lr * o_.weight_decay : 0.f;
    u.nesterov = o_.nesterov;
    u.first = steps_ == 0;  // PyTorch starts the buffer at the first gradient
    u.gate = gate;
    backend(params)
        .sgd_update(in_range(params), in_range(grads), momentum_.view(0, {n}), u, classes_, at_copy(copy, lo_, {n}));
  }
}

}  // namespace replica::optim
