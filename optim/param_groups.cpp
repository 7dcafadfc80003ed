// Parameter groups: runs of the flat parameter buffer that share a weight-decay setting, so every
// optimizer's fused update walks a few long ranges instead of one tensor at a time.
#include <algorithm>

#include "core/errors.h"
#include "optim/optimizer.h"

namespace replica::optim {

void require_chunk_aligned(const nn::ParamRegistry& reg, const std::string& who) {
  for (const auto& p : reg.params())
    if (p.offset % ops::kParamChunk != 0)
      throw Error(who + ": parameter " + p.name + " starts at flat element " + std::to_string(p.offset) +
                  ", not on a " + std::to_string(ops::kParamChunk) +
                  "-element boundary (the optimizers' group table has one entry per chunk; nn::Model lays "
                  "slots out so)");
}

std::vector<ParamGroup> make_groups(const nn::ParamRegistry& reg, bool no_decay_bn_bias) {
  require_chunk_aligned(reg, "optimizer");
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

std::vector<ParamGroup> clip_groups(const std::vector<ParamGroup>& groups, int64_t lo, int64_t hi) {
  std::vector<ParamGroup> out;
  for (const auto& g : groups) {
    const int64_t a = std::max(g.offset, lo), e = std::min(g.offset + g.count, hi);
    if (a < e) out.push_back({a, e - a, g.decay});
  }
  return out;
}

void Optimizer::set_range(int64_t total, ShardRange r) {
  const int64_t hi = r.hi < 0 ? total : r.hi;
  if (r.lo < 0 || r.lo > hi || hi > total)
    throw Error(name() + ": shard range [" + std::to_string(r.lo) + ", " + std::to_string(hi) +
                ") does not fit a flat buffer of " + std::to_string(total) + " elements");
  lo_ = r.lo;
  hi_ = hi;
  total_ = total;
}

std::vector<uint8_t> decay_classes(const std::vector<ParamGroup>& groups, int64_t chunks) {
  std::vector<uint8_t> t(static_cast<size_t>(std::max<int64_t>(chunks, 1)), 0);
  for (const auto& g : groups) set_chunks<uint8_t>(t, g.offset, g.count, g.decay ? 1 : 0);
  return t;
}

namespace {
template <typename T>
ops::ChunkClasses upload(MemoryPool& pool, const std::vector<T>& entries, DType dtype, int64_t base) {
  ops::ChunkClasses c;
  c.table = Tensor::empty(pool, {static_cast<int64_t>(entries.size())}, dtype, MemTag::optimizer);
  tensor_from_bytes(c.table, entries.data(), entries.size() * sizeof(T));
  c.base = base;
  return c;
}
}  // namespace

ops::ChunkClasses Optimizer::upload_classes(MemoryPool& pool, const std::vector<uint8_t>& entries) const {
  return upload(pool, entries, DType::u8, lo_);
}
ops::ChunkClasses Optimizer::upload_classes(MemoryPool& pool, const std::vector<int32_t>& entries) const {
  return upload(pool, entries, DType::i32, lo_);
}

Tensor Optimizer::at(const Tensor& t, int64_t offset, Shape s) const {
  if (t.numel() == total_) return t.view(offset, s);
  if (t.numel() == hi_ - lo_ || (hi_ == lo_ && t.numel() == 1)) return t.view(offset - lo_, s);
  throw Error(name() + ": a buffer of " + std::to_string(t.numel()) + " elements is neither the whole flat buffer (" +
              std::to_string(total_) + ") nor this optimizer's range [" + std::to_string(lo_) + ", " +
              std::to_string(hi_) + ")");
}

}  // namespace replica::optim
