// Mixed precision on the CPU backend: 16-bit tensors (f16, bf16) are stored in 16 bits, so they
// round, overflow and underflow as on a GPU, but every kernel computes in f32. A kernel handed
// any 16-bit tensor converts its inputs to f32 scratch (pool tag workspace), runs the f32 path,
// and rounds its outputs back to their 16-bit storage once. Every CPU kernel starts with
//
//   if (run_in_f32({In(x), In(w), Out(y)}, [&](auto& t) { conv2d_forward(t[0], t[1], t[2], g, ws);
//   })) return;
#pragma once
#include <algorithm>
#include <array>
#include <initializer_list>
#include <utility>
#include <vector>

#include "core/captured_work.h"
#include "core/errors.h"
#include "core/tensor.h"
#include "ops/cpu/parallel_for.h"
#include "ops/cpu/threads.h"

#ifndef REPLICA_CPU_ISA_NS
#error "included only by the per-level CPU kernels (ops/cpu/cpu_backend.h)"
#endif

// In the level's namespace: inline code compiled with one level's flags must not be linked in
// place of another's (ops/cpu/cpu_backend.h).
namespace replica::ops::REPLICA_CPU_ISA_NS {

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
  // A replayed call's tensors name memory without owning it (ops/recording_backend.h): its scratch
  // comes from the replay's workspace.
  if (!pool) pool = replaying_workspace();
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

// Elementwise ops (element i of every output depends on element i of the inputs only) skip the
// whole-tensor scratch: 16-bit operands are converted a tile at a time into f32 buffers that
// stay in L1, f(p, n) runs on the tile (p[k]: operand k's n floats), and 16-bit outputs are
// rounded back before the next tile; f32 operands are passed through in place. The arithmetic is
// run_in_f32's exactly (16 -> 32 bits is exact, one rounding on store), at a fraction of its
// memory traffic (bench/RESULTS.md, fp16 and bf16 on the CPU). All operands have one size.
template <typename F>
void elementwise_in_f32(std::initializer_list<F32Arg> args, F&& f) {
  constexpr int64_t kTile = 1024;
  constexpr size_t kMax = 4;
  if (args.size() > kMax) throw Error("elementwise_in_f32: at most 4 operands");
  const F32Arg* a = args.begin();
  const size_t K = args.size();
  const int64_t n = a[0].t->numel();
  // Tiles are independent, so a replica with intra-op threads spreads them (each thread's
  // buffers on its own stack); below 16 tiles a fork costs more than it saves.
  const int64_t tiles = (n + kTile - 1) / kTile;
  parallel_for(tiles, tiles >= 16 ? intra_op_threads() : 1, [&](int64_t tile, int) {
    const int64_t i = tile * kTile, m = std::min(kTile, n - i);
    alignas(64) float buf[kMax][kTile];
    std::array<float*, kMax> p{};
    for (size_t k = 0; k < K; ++k) {
      const Tensor& t = *a[k].t;
      if (t.dtype() == DType::f32) {
        p[k] = t.data<float>() + i;
        continue;
      }
      p[k] = buf[k];
      if (a[k].role != F32Arg::out)
        convert(static_cast<const char*>(t.raw()) + i * dtype_size(t.dtype()), t.dtype(), buf[k], DType::f32,
                static_cast<size_t>(m));
    }
    f(p.data(), m);
    for (size_t k = 0; k < K; ++k) {
      const Tensor& t = *a[k].t;
      if (t.dtype() != DType::f32 && a[k].role != F32Arg::in)
        convert(buf[k], DType::f32, static_cast<char*>(t.raw()) + i * dtype_size(t.dtype()), t.dtype(),
                static_cast<size_t>(m));
    }
  });
}

}  // namespace replica::ops::REPLICA_CPU_ISA_NS
