// Mixed precision on the CPU backend: 16-bit tensors (f16, bf16) are stored in 16 bits, so they
// round, overflow and underflow as on a GPU, but every kernel computes in f32. A kernel handed
// any 16-bit tensor converts its inputs to f32 scratch (pool tag workspace), runs the f32 path,
// and rounds its outputs back to their 16-bit storage once.
#pragma once
#include <initializer_list>
#include <vector>

#include "core/errors.h"
#include "core/tensor.h"

namespace replica::ops {

inline bool all_f32(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->defined() && t->dtype() != DType::f32 && t->dtype() != DType::i32) return false;
  return true;
}

class MixedScope {
 public:
  explicit MixedScope(std::initializer_list<const Tensor*> ts) {
    for (const Tensor* t : ts)
      if (t->defined() && t->pool()) {
        pool_ = t->pool();
        break;
      }
    if (!pool_) throw Error("mixed precision: no tensor of this op comes from a pool to take f32 scratch from");
  }
  // f32 copy of a 16-bit input (the tensor itself when it already is f32).
  Tensor in(const Tensor& t) {
    if (!t.defined() || t.dtype() == DType::f32 || t.dtype() == DType::i32) return t;
    Tensor f = Tensor::empty(*pool_, t.shape(), DType::f32, MemTag::workspace);
    convert(t.raw(), t.dtype(), f.raw(), DType::f32, static_cast<size_t>(t.numel()));
    return f;
  }
  // f32 scratch for a 16-bit output, rounded back into `t` by finish().
  Tensor out(const Tensor& t) {
    if (!t.defined() || t.dtype() == DType::f32 || t.dtype() == DType::i32) return t;
    Tensor f = Tensor::empty(*pool_, t.shape(), DType::f32, MemTag::workspace);
    back_.push_back({f, t});
    return f;
  }
  // Both: read, then written back (accumulators, in-place outputs).
  Tensor inout(const Tensor& t) {
    Tensor f = in(t);
    if (f.raw() != t.raw()) back_.push_back({f, t});
    return f;
  }
  void finish() {
    for (auto& [f, t] : back_) convert(f.raw(), DType::f32, t.raw(), t.dtype(), static_cast<size_t>(t.numel()));
    back_.clear();
  }

 private:
  MemoryPool* pool_ = nullptr;
  std::vector<std::pair<Tensor, Tensor>> back_;
};

}  // namespace replica::ops
