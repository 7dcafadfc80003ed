// Parameter groups: runs of the flat parameter buffer that share a weight-decay setting, so every
// optimizer's fused update walks a few long ranges instead of one tensor at a time.
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

}  // namespace replica::optim
