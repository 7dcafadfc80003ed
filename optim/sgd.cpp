// SGD with momentum (PyTorch's form: buf = m * buf + g; Nesterov uses g + m * buf), coupled or
// decoupled weight decay, fused over the flat buffer.
#include <cstring>

#include "optim/optimizer.h"

namespace replica::optim {

std::vector<ParamGroup> make_groups(const nn::ParamRegistry& reg, bool no_decay_bn_bias) {
  std::vector<ParamGroup> g;
  for (const auto& p : reg.params()) {
    bool decay = !(no_decay_bn_bias && p.kind != nn::ParamKind::weight);
    int64_t n = p.shape.numel();
    if (!g.empty() && g.back().decay == decay && g.back().offset + g.back().count <= p.offset) {
      g.back().count = p.offset + n - g.back().offset;  // spans the alignment padding too (zeros)
    } else {
      g.push_back({p.offset, n, decay});
    }
  }
  return g;
}

Sgd::Sgd(const nn::ParamRegistry& reg, int64_t total, MemoryPool& pool, SgdOptions o)
    : o_(o), groups_(make_groups(reg, o.no_decay_bn_bias)) {
  momentum_ = Tensor::zeros(pool, {std::max<int64_t>(total, 1)}, DType::f32, MemTag::optimizer);
}

void Sgd::step(const Tensor& params, const Tensor& grads, float lr) {
  float* p = params.data<float>();
  const float* g = grads.data<float>();
  float* buf = momentum_.data<float>();
  const float m = o_.momentum;
  const bool first = steps_ == 0;  // PyTorch starts the buffer at the first gradient
  for (const auto& grp : groups_) {
    const float wd = grp.decay ? o_.weight_decay : 0.f;
    const float cwd = o_.decoupled ? 0.f : wd;
    const float dwd = o_.decoupled ? lr * wd : 0.f;
    for (int64_t i = grp.offset, e = grp.offset + grp.count; i < e; ++i) {
      float d = g[i] + cwd * p[i];
      if (m != 0.f) {
        buf[i] = first ? d : m * buf[i] + d;
        d = o_.nesterov ? d + m * buf[i] : buf[i];
      }
      p[i] -= lr * d + dwd * p[i];
    }
  }
  steps_++;
}

}  // namespace replica::optim
