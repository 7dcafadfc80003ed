// CPU optimizer kernels over f32 flat-buffer views, and the small reductions the optimizers and
// frozen batch norm need. These loops are the reference the CUDA kernels are tested against.
#include <algorithm>
#include <cmath>

#include "core/errors.h"
#include "ops/cpu/cpu_backend.h"

namespace replica::ops::REPLICA_CPU_ISA_NS {
namespace {
void require_f32(std::initializer_list<const Tensor*> ts, const char* who) {
  for (const Tensor* t : ts)
    if (t->dtype() != DType::f32) throw ShapeError(std::string(who) + ": expected f32, got " + t->str());
}

// Runs update(lo, hi) over [0, n) in blocks, each followed by its elements' rounding into `copy`
// (when defined) while they are still in cache: one pass over the parameters, and the very
// conversion Backend::cast makes, so the copy has cast's bits.
constexpr int64_t kCopyBlock = 4096;
template <typename Update>
void blocks_with_copy(int64_t n, const float* p, const Tensor& copy, Update&& update) {
  if (!copy.defined()) return update(int64_t(0), n);
  const size_t es = dtype_size(copy.dtype());
  for (int64_t lo = 0; lo < n; lo += kCopyBlock) {
    const int64_t hi = std::min(n, lo + kCopyBlock);
    update(lo, hi);
    convert(p + lo, DType::f32, static_cast<char*>(copy.raw()) + static_cast<size_t>(lo) * es, copy.dtype(),
            static_cast<size_t>(hi - lo));
  }
}

// A skipped step's gate (Backend::SgdUpdate::gate): the update leaves everything as it was.
bool closed(const Tensor& gate) { return gate.defined() && gate.data<float>()[0] == 0.f; }

// Runs body(a, b, class) over [lo, hi) of a tensor starting at flat element c.base, cut where the
// group class changes (a run is whole chunks but for its ends): the inner loops keep their
// loop-invariant coefficients, as one call per group had them. `none`: the class without a table.
template <typename T, typename Body>
void class_runs(const ChunkClasses& c, int64_t lo, int64_t hi, T none, Body&& body) {
  if (!c.table.defined()) return body(lo, hi, none);
  const T* t = c.table.data<T>();
  for (int64_t a = lo; a < hi;) {
    const T v = t[(c.base + a) / kParamChunk];
    int64_t b = ((c.base + a) / kParamChunk + 1) * kParamChunk - c.base;  // this chunk's end
    while (b < hi && t[(c.base + b) / kParamChunk] == v) b += kParamChunk;
    b = std::min(b, hi);
    body(a, b, v);
    a = b;
  }
}
}  // namespace

std::vector<double> CpuBackend::segment_sum_squares(const Tensor& x,
                                                    const std::vector<std::pair<int64_t, int64_t>>& segments) {
  require_f32({&x}, "segment_sum_squares");
  note_host_sync();
  const float* p = x.data<float>();
  std::vector<double> out;
  out.reserve(segments.size());
  for (auto [off, n] : segments) {
    if (off < 0 || off + n > x.numel()) throw ShapeError("segment_sum_squares: segment past the end of " + x.str());
    double s = 0;
    for (int64_t i = off; i < off + n; ++i) s += static_cast<double>(p[i]) * p[i];
    out.push_back(s);
  }
  return out;
}

void CpuBackend::segment_sum_squares_into(const Tensor& x, const std::vector<std::pair<int64_t, int64_t>>& segments,
                                          const Tensor& out) {
  require_f32({&x, &out}, "segment_sum_squares_into");
  if (out.numel() < static_cast<int64_t>(segments.size()))
    throw ShapeError("segment_sum_squares_into: " + out.str() + " holds fewer than " +
                     std::to_string(segments.size()) + " sums");
  const float* p = x.data<float>();
  float* o = out.data<float>();
  for (size_t k = 0; k < segments.size(); ++k) {
    const auto [off, n] = segments[k];
    if (off < 0 || off + n > x.numel())
      throw ShapeError("segment_sum_squares_into: segment past the end of " + x.str());
    double s = 0;
    for (int64_t i = off; i < off + n; ++i) s += static_cast<double>(p[i]) * p[i];
    o[k] = static_cast<float>(s);
  }
}

void CpuBackend::sum_in_order_into(const Tensor& x, const Tensor& out) {
  require_f32({&x, &out}, "sum_in_order_into");
  const float* p = x.data<float>();
  double s = 0;
  for (int64_t i = 0, n = x.numel(); i < n; ++i) s += p[i];
  out.data<float>()[0] = static_cast<float>(s);
}

void CpuBackend::step_gate(const Tensor& stats, const StepGateAt& at, double max_norm) {
  check_step_gate_at(stats, at);
  float* s = stats.data<float>();
  s[at.apply] = s[at.nonfinite] == 0.f && s[at.bad_label] == 0.f && std::isfinite(s[at.loss]) ? 1.f : 0.f;
  const double norm = std::sqrt(static_cast<double>(s[at.grad_squares]));
  s[at.clip] = max_norm > 0 && norm > max_norm ? static_cast<float>(max_norm / (norm + 1e-6)) : 1.f;
}

void CpuBackend::rsqrt_eps(const Tensor& x, const Tensor& y, float eps) {
  require_f32({&x, &y}, "rsqrt_eps");
  for (int64_t i = 0; i < x.numel(); ++i) y.data<float>()[i] = 1.0f / std::sqrt(x.data<float>()[i] + eps);
}

void CpuBackend::sgd_update(const Tensor& params, const Tensor& grads, const Tensor& momentum,
                            const SgdUpdate& u, const ChunkClasses& classes, const Tensor& copy) {
  require_f32({&params, &grads, &momentum}, "sgd_update");
  check_copy(copy, params, "sgd_update");
  check_chunk_classes(classes, params, DType::u8, false, "sgd_update");
  check_gate(u.gate, params, "sgd_update");
  for (const StepScalar* s : {&u.lr, &u.decoupled_wd, &u.first}) check_step_scalar(*s, params, "sgd_update");
  if (closed(u.gate)) return;
  // Locals and restrict: the loops vectorise (read through `u` and possibly aliased pointers,
  // every store reloaded the coefficients: 36% of the copy rate on ResNet-50's buffer).
  float* __restrict p = params.data<float>();
  const float* __restrict g = grads.data<float>();
  float* __restrict buf = momentum.data<float>();
  const float m = u.momentum, lr = host_value(u.lr), decoupled_wd = host_value(u.decoupled_wd);
  const bool first = host_value(u.first) != 0.f, nesterov = u.nesterov;
  blocks_with_copy(params.numel(), p, copy, [&](int64_t lo, int64_t hi) {
    class_runs<uint8_t>(classes, lo, hi, 1, [&](int64_t a, int64_t e, uint8_t decay) {
      const float cwd = decay ? u.coupled_wd : 0.f, dwd = decay ? decoupled_wd : 0.f;
      if (m == 0.f) {
        for (int64_t i = a; i < e; ++i) p[i] -= lr * (g[i] + cwd * p[i]) + dwd * p[i];
        return;
      }
      for (int64_t i = a; i < e; ++i) {
        const float d = g[i] + cwd * p[i];
        const float b = first ? d : m * buf[i] + d;
        buf[i] = b;
        p[i] -= lr * (nesterov ? d + m * b : b) + dwd * p[i];
      }
    });
  });
}

void CpuBackend::adamw_update(const Tensor& params, const Tensor& grads, const Tensor& m1, const Tensor& m2,
                              const AdamWUpdate& u, const ChunkClasses& classes, const Tensor& copy) {
  require_f32({&params, &grads, &m1, &m2}, "adamw_update");
  check_copy(copy, params, "adamw_update");
  check_chunk_classes(classes, params, DType::u8, false, "adamw_update");
  check_gate(u.gate, params, "adamw_update");
  for (const StepScalar* s : {&u.decay, &u.step_size, &u.inv_sqrt_bc2}) check_step_scalar(*s, params, "adamw_update");
  if (closed(u.gate)) return;
  float* __restrict p = params.data<float>();
  const float* __restrict g = grads.data<float>();
  float* __restrict m = m1.data<float>();
  float* __restrict v = m2.data<float>();
  const float b1 = u.beta1, b2 = u.beta2, step = host_value(u.step_size), ibc2 = host_value(u.inv_sqrt_bc2);
  const float eps = u.eps, decay_factor = host_value(u.decay);
  blocks_with_copy(params.numel(), p, copy, [&](int64_t lo, int64_t hi) {
    class_runs<uint8_t>(classes, lo, hi, 1, [&](int64_t a, int64_t e, uint8_t decay) {
      const float dc = decay ? decay_factor : 1.f;
      for (int64_t i = a; i < e; ++i) {
        const float pi = p[i] * dc;
        const float mi = b1 * m[i] + (1.f - b1) * g[i];
        const float vi = b2 * v[i] + (1.f - b2) * g[i] * g[i];
        m[i] = mi;
        v[i] = vi;
        p[i] = pi - step * mi / (std::sqrt(vi) * ibc2 + eps);
      }
    });
  });
}

void CpuBackend::lars_trust_ratios(const Tensor& params, const Tensor& grads,
                                   const std::vector<std::pair<int64_t, int64_t>>& segments, float trust, float wd,
                                   float eps, const Tensor& ratios) {
  require_f32({&params, &grads, &ratios}, "lars_trust_ratios");
  if (ratios.numel() < static_cast<int64_t>(segments.size()))
    throw ShapeError("lars_trust_ratios: " + ratios.str() + " holds fewer than " + std::to_string(segments.size()) +
                     " ratios");
  const float* w = params.data<float>();
  const float* g = grads.data<float>();
  float* out = ratios.data<float>();
  for (size_t i = 0; i < segments.size(); ++i) {
    const auto [off, n] = segments[i];
    if (off < 0 || off + n > params.numel()) throw ShapeError("lars_trust_ratios: segment past the end of " + params.str());
    double ws = 0, gs = 0;
    for (int64_t j = off; j < off + n; ++j) {
      ws += static_cast<double>(w[j]) * w[j];
      gs += static_cast<double>(g[j]) * g[j];
    }
    const double wn = std::sqrt(ws), gn = std::sqrt(gs);
    out[i] = wn > 0 && gn > 0 ? static_cast<float>(trust * wn / (gn + wd * wn + eps)) : 1.f;
  }
}

void CpuBackend::lars_update(const Tensor& params, const Tensor& grads, const Tensor& momentum,
                             const StepScalar& step_lr, const Tensor& ratios, float mom, float wd,
                             const ChunkClasses& classes, const Tensor& copy, const Tensor& gate) {
  require_f32({&params, &grads, &momentum}, "lars_update");
  check_copy(copy, params, "lars_update");
  check_chunk_classes(classes, params, DType::i32, true, "lars_update");
  check_gate(gate, params, "lars_update");
  check_step_scalar(step_lr, params, "lars_update");
  if (closed(gate)) return;
  const float lr = host_value(step_lr);
  if (ratios.defined()) require_f32({&ratios}, "lars_update");
  float* __restrict p = params.data<float>();
  const float* __restrict g = grads.data<float>();
  float* __restrict buf = momentum.data<float>();
  blocks_with_copy(params.numel(), p, copy, [&](int64_t lo, int64_t hi) {
    class_runs<int32_t>(classes, lo, hi, -1, [&](int64_t a, int64_t b, int32_t k) {
      if (k >= 0 && (!ratios.defined() || k >= ratios.numel()))
        throw ShapeError("lars_update: the group table names trust ratio " + std::to_string(k) + ", past " +
                         (ratios.defined() ? ratios.str() : std::string("no ratios")));
      const float scaled_lr = k >= 0 ? lr * ratios.data<float>()[k] : lr;
      const float w = k >= 0 ? wd : 0.f;
      for (int64_t i = a; i < b; ++i) {
        const float bi = mom * buf[i] + scaled_lr * (g[i] + w * p[i]);
        buf[i] = bi;
        p[i] -= bi;
      }
    });
  });
}

}  // namespace replica::ops::REPLICA_CPU_ISA_NS
