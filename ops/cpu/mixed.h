// Mixed precision on the CPU backend: 16-bit tensors (f16, bf16) are stored in 16 bits, so they
// round, overflow and underflow as on a GPU, but every kernel computes in f32. A kernel handed
// any 16-bit tensor converts its inputs to f32 scratch (pool tag workspace), runs the f32 path,
// and rounds its outputs back to their 16-bit storage once. Every CPU kernel starts with
//
//   if (run_in_f32({In(x), In(w), Out(y)}, [&](auto& t) { conv2d_forward(t[0], t[1], t[2], g, ws);
//   })) return;
#pragma once
#include <initializer_list>
#include <utility>
#include <vector>

#include "core/errors.h"
#include "core/tensor.h"

namespace replica::ops {

// How an op uses a tensor.
struct F32Arg {
  enum Role { in, out, inout };
  const Tensor* t;
  Role role;
};
inline F32Arg In(const Tensor& t) { return {&t, F32Arg::in}; }
inline F32Arg Out(const Tensor& t) { return {&t, F32Arg::out}; }
inline F32Arg InOut(const Tensor& t) { return {&t, F32Arg::inout}; }

namespace detail {
inline bool is_f32_or_int(const Tensor& t) {
  return !t.defined() || t.dtype() == DType::f32 || t.dtype() == DType::i32;
}
}  // namespace detail

// When any of `args` is 16-bit: calls f with a std::vector<Tensor> of f32 versions (same order),
// rounds the outputs back once, returns true. When all are f32 (or integer) returns false.
template <typename F>
bool run_in_f32(std::initializer_list<F32Arg> args, F&& f) {
  MemoryPool* pool = nullptr;
  bool all = true;
  for (const auto& a : args) {
    all = all && detail::is_f32_or_int(*a.t);
    if (!pool && a.t->defined()) pool = a.t->pool();
  }
  if (all) return false;
  if (!pool)
    throw Error("mixed precision: no tensor of this op comes from a pool to take f32 scratch from");
  std::vector<Tensor> t;
  std::vector<std::pair<Tensor, Tensor>> back;  // (f32 scratch, 16-bit destination)
  for (const auto& a : args) {
    const Tensor& src = *a.t;
    if (detail::is_f32_or_int(src)) {
      t.push_back(src);
      continue;
    }
    Tensor f = Tensor::empty(*pool, src.shape(), DType::f32, MemTag::workspace);
    if (a.role != F32Arg::out)
      convert(src.raw(), src.dtype(), f.raw(), DType::f32, static_cast<size_t>(src.numel()));
    if (a.role != F32Arg::in) back.emplace_back(f, src);
    t.push_back(f);
  }
  f(t);
  for (auto& [scratch, dst] : back)
    convert(scratch.raw(), DType::f32, dst.raw(), dst.dtype(), static_cast<size_t>(dst.numel()));
  return true;
}

}  // namespace replica::ops
