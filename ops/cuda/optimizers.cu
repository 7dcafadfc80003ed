// The fused optimizer updates (SGD, AdamW, LARS and its trust ratios) over the flat f32 buffers,
// every parameter group in one launch, and the step's verdict (step_gate) and clip factor
// (scale_by). Formulas and order of operations as ops/cpu/optim_kernels.cpp.
#include <initializer_list>

#include "ops/cuda/kernel_common.cuh"

namespace replica::ops::cuk {
namespace {

// LARS trust ratios in two passes: a block per fixed-size chunk of a tensor adds both squared
// norms in double (part[2k], part[2k + 1]); then a thread per tensor adds its chunks' sums in
// order and forms the ratio (CPU: optim_kernels.cpp). A block per whole tensor left ResNet-50's
// largest (2.4M weights, 19 MB read) to one multiprocessor while the others idled.
__global__ void k_lars_chunk_sums(const float* w, const float* g, const int64_t* off, const int64_t* cnt,
                                  double* part) {
  const int k = blockIdx.x;
  double ws = 0, gs = 0;
  for (int64_t i = threadIdx.x; i < cnt[k]; i += blockDim.x) {
    const double a = w[off[k] + i], b = g[off[k] + i];
    ws += a * a;
    gs += b * b;
  }
  ws = block_sum(ws);
  gs = block_sum(gs);
  if (threadIdx.x == 0) part[2 * k] = ws, part[2 * k + 1] = gs;
}
__global__ void k_lars_ratios(const double* part, const int64_t* first, const int64_t* chunks, int segments,
                              float trust, float wd, float eps, float* out) {
  const int seg = blockIdx.x * blockDim.x + threadIdx.x;
  if (seg >= segments) return;
  double ws = 0, gs = 0;
  for (int64_t k = first[seg]; k < first[seg] + chunks[seg]; ++k) ws += part[2 * k], gs += part[2 * k + 1];
  const double wn = sqrt(ws), gn = sqrt(gs);
  out[seg] = wn > 0 && gn > 0 ? static_cast<float>(trust * wn / (gn + wd * wn + eps)) : 1.f;
}

// ---- optimizers -------------------------------------------------------------------------------

// One thread: the step's verdict and clip factor from its scalars (Backend::step_gate; the CPU's
// formula, in double for the norm).
__global__ void k_step_gate(float* s, int64_t loss, int64_t bad_label, int64_t nonfinite, int64_t grad_squares,
                            int64_t apply, int64_t clip, double max_norm) {
  s[apply] = s[nonfinite] == 0.f && s[bad_label] == 0.f && isfinite(s[loss]) ? 1.f : 0.f;
  const double norm = sqrt(static_cast<double>(s[grad_squares]));
  s[clip] = max_norm > 0 && norm > max_norm ? static_cast<float>(max_norm / (norm + 1e-6)) : 1.f;
}

__global__ void k_scale_by(float* y, int64_t n, const float* factor) {
  const float f = *factor;
  GRID_STRIDE(i, n) y[i] *= f;
}

// Each update stores the new parameter and, when `copy` is given, its rounding into the 16-bit
// compute copy (st: cast's rounding): the copy costs 2 bytes written, not another pass.
__device__ __forceinline__ void store_param(float* p, DPtr copy, int64_t i, float v) {
  p[i] = v;
  if (copy.p) st(copy.mut(), copy.dt, i, v);
}

// Every group of the flat buffer in one launch: an element's group coefficients come from its
// chunk's entry in the group table (one byte or int per 16 elements, read by 16 neighbouring
// threads at once), chosen by selects, so each element computes what a call per group computed.
// The per-element pieces are shared by the scalar kernels and the 16-byte vector ones below, so
// the two give the same bits.
__device__ __forceinline__ bool closed(const float* gate) { return gate && *gate == 0.f; }  // a skipped step
__device__ __forceinline__ bool decays(const uint8_t* cls, int64_t base, int64_t i) {
  return !cls || cls[(base + i) >> kChunkShift] != 0;
}
// LARS: the element's learning rate times its trust ratio, and its weight decay (none unadapted).
__device__ __forceinline__ float2 lars_coefficients(const int32_t* cls, int64_t base, int64_t i, float lr,
                                                   const float* ratios, float wd) {
  const int32_t k = cls[(base + i) >> kChunkShift];
  return k >= 0 ? make_float2(lr * ratios[k], wd) : make_float2(lr, 0.f);
}
// One element's update: the new parameter, its state updated in place (PyTorch's order of
// operations, as ops/cpu/optim_kernels.cpp).
__device__ __forceinline__ float sgd_one(float p, float g, float& b, float lr, float m, float cwd, float dwd,
                                         bool nesterov, bool first) {
  float d = g + cwd * p;
  if (m != 0.f) {
    b = first ? d : m * b + d;
    d = nesterov ? d + m * b : b;
  }
  return p - (lr * d + dwd * p);
}
__device__ __forceinline__ float adamw_one(float p, float g, float& m, float& v, float b1, float b2, float eps,
                                           float decay, float step, float inv_sqrt_bc2) {
  const float pd = p * decay;
  m = b1 * m + (1.f - b1) * g;
  v = b2 * v + (1.f - b2) * g * g;
  return pd - step * m / (sqrtf(v) * inv_sqrt_bc2 + eps);
}
__device__ __forceinline__ float lars_one(float p, float g, float& b, float2 c, float m) {
  b = m * b + c.x * (g + c.y * p);
  return p - b;
}

__global__ void k_sgd(float* p, const float* g, float* buf, int64_t n, const uint8_t* cls, int64_t base, Knob lr_k,
                      float m, float cwd, Knob dwd_k, bool nesterov, Knob first_k, DPtr copy, const float* gate) {
  if (closed(gate)) return;
  const float lr = lr_k.get(), dwd = dwd_k.get();
  const bool first = first_k.get() != 0.f;
  GRID_STRIDE(i, n) {
    const bool d = decays(cls, base, i);
    float b = m != 0.f && !first ? buf[i] : 0.f;  // the first step starts the buffer
    const float v = sgd_one(p[i], g[i], b, lr, m, d ? cwd : 0.f, d ? dwd : 0.f, nesterov, first);
    if (m != 0.f) buf[i] = b;
    store_param(p, copy, i, v);
  }
}

__global__ void k_adamw(float* p, const float* g, float* m, float* v, int64_t n, const uint8_t* cls, int64_t base,
                        float b1, float b2, float eps, Knob decay_k, Knob step_k, Knob ibc2_k, DPtr copy,
                        const float* gate) {
  if (closed(gate)) return;
  const float decay = decay_k.get(), step = step_k.get(), inv_sqrt_bc2 = ibc2_k.get();
  GRID_STRIDE(i, n) {
    float mi = m[i], vi = v[i];
    const float pv = adamw_one(p[i], g[i], mi, vi, b1, b2, eps, decays(cls, base, i) ? decay : 1.f, step, inv_sqrt_bc2);
    m[i] = mi;
    v[i] = vi;
    store_param(p, copy, i, pv);
  }
}

__global__ void k_lars(float* p, const float* g, float* buf, int64_t n, const int32_t* cls, int64_t base, Knob lr_k,
                       const float* ratios, float m, float wd, DPtr copy, const float* gate) {
  if (closed(gate)) return;
  const float lr = lr_k.get();
  GRID_STRIDE(i, n) {
    float b = buf[i];
    const float v = lars_one(p[i], g[i], b, lars_coefficients(cls, base, i, lr, ratios, wd), m);
    buf[i] = b;
    store_param(p, copy, i, v);
  }
}

// The same three updates, 8 elements a thread in 16-byte accesses (the parameters, gradients and
// state two float4s each, the 16-bit copy one 16-byte store), the copy's type a template
// parameter: the scalar kernels above read and write one 4-byte word per thread and access, and
// round into the copy through a run-time switch. Used when every buffer is 16-byte aligned and
// the range's first flat element is a multiple of 8 (8 elements never straddle a group-table
// chunk); the scalar kernels take the rest and the tail.
template <typename T>
__device__ __forceinline__ void store_params8(float* p, T* copy, int64_t i, const float (&v)[kVec]) {
  store8(p + i, v);
  if (copy) store8(copy + i, v);
}

template <typename T>
__global__ void k_sgd8(float* p, const float* g, float* buf, int64_t nv, const uint8_t* cls, int64_t base, Knob lr_k,
                       float m, float cwd, Knob dwd_k, bool nesterov, Knob first_k, T* copy, const float* gate) {
  if (closed(gate)) return;
  const float lr = lr_k.get(), dwd = dwd_k.get();
  const bool first = first_k.get() != 0.f;
  GRID_STRIDE(v, nv) {
    const int64_t i = v * kVec;
    const bool d = decays(cls, base, i);
    float pv[kVec], gv[kVec], bv[kVec] = {};
    load8(p + i, pv);
    load8(g + i, gv);
    if (m != 0.f && !first) load8(buf + i, bv);
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      pv[j] = sgd_one(pv[j], gv[j], bv[j], lr, m, d ? cwd : 0.f, d ? dwd : 0.f, nesterov, first);
    if (m != 0.f) store8(buf + i, bv);
    store_params8(p, copy, i, pv);
  }
}

template <typename T>
__global__ void k_adamw8(float* p, const float* g, float* m, float* v, int64_t nv, const uint8_t* cls, int64_t base,
                         float b1, float b2, float eps, Knob decay_k, Knob step_k, Knob ibc2_k, T* copy,
                         const float* gate) {
  if (closed(gate)) return;
  const float decay = decay_k.get(), step = step_k.get(), inv_sqrt_bc2 = ibc2_k.get();
  GRID_STRIDE(k, nv) {
    const int64_t i = k * kVec;
    const float dc = decays(cls, base, i) ? decay : 1.f;
    float pv[kVec], gv[kVec], mv[kVec], vv[kVec];
    load8(p + i, pv);
    load8(g + i, gv);
    load8(m + i, mv);
    load8(v + i, vv);
#pragma unroll
    for (int j = 0; j < kVec; ++j) pv[j] = adamw_one(pv[j], gv[j], mv[j], vv[j], b1, b2, eps, dc, step, inv_sqrt_bc2);
    store8(m + i, mv);
    store8(v + i, vv);
    store_params8(p, copy, i, pv);
  }
}

template <typename T>
__global__ void k_lars8(float* p, const float* g, float* buf, int64_t nv, const int32_t* cls, int64_t base, Knob lr_k,
                        const float* ratios, float m, float wd, T* copy, const float* gate) {
  if (closed(gate)) return;
  const float lr = lr_k.get();
  GRID_STRIDE(v, nv) {
    const int64_t i = v * kVec;
    const float2 c = lars_coefficients(cls, base, i, lr, ratios, wd);
    float pv[kVec], gv[kVec], bv[kVec];
    load8(p + i, pv);
    load8(g + i, gv);
    load8(buf + i, bv);
#pragma unroll
    for (int j = 0; j < kVec; ++j) pv[j] = lars_one(pv[j], gv[j], bv[j], c, m);
    store8(buf + i, bv);
    store_params8(p, copy, i, pv);
  }
}

}  // namespace

// How many leading elements of an update go to the vector kernels: all but the n % 8 tail when
// every buffer is 16-byte aligned and the first flat element a multiple of 8; else none.
int64_t vector_head(int64_t n, int64_t base, DPtr copy, std::initializer_list<const void*> bufs) {
  if (base % kVec != 0 || (copy.p && !aligned16(copy.p))) return 0;
  for (const void* b : bufs)
    if (!aligned16(b)) return 0;
  return n / kVec * kVec;
}
DPtr offset(DPtr d, int64_t i) {
  if (!d.p) return d;
  return {static_cast<const char*>(d.p) + i * (d.dt == 0 ? 4 : 2), d.dt};
}
// Runs launch(copy pointer of type T) with the copy's storage type (none: a null float*).
template <typename Launch>
void with_copy_type(DPtr copy, Launch&& launch) {
  if (!copy.p) launch(static_cast<float*>(nullptr));
  else if (copy.dt == kF16) launch(static_cast<__half*>(copy.mut()));
  else if (copy.dt == kBF16) launch(static_cast<__nv_bfloat16*>(copy.mut()));
  else throw ShapeError("optimizer update: the compute copy must be f16 or bf16");
}

void sgd_update(float* p, const float* g, float* buf, int64_t n, const uint8_t* cls, int64_t base, Knob lr,
                float momentum, float cwd, Knob dwd, bool nesterov, Knob first, DPtr copy, const float* gate,
                cudaStream_t s) {
  const int64_t h = vector_head(n, base, copy, {p, g, buf});
  if (h > 0) {
    with_copy_type(copy, [&](auto* c) {
      k_sgd8<<<grid_for(h / kVec), kThreads, 0, s>>>(p, g, buf, h / kVec, cls, base, lr, momentum, cwd, dwd, nesterov,
                                                     first, c, gate);
    });
    check_launch("k_sgd8");
  }
  LAUNCH(k_sgd, n - h, s, p + h, g + h, buf + h, n - h, cls, base + h, lr, momentum, cwd, dwd, nesterov, first,
         offset(copy, h), gate);
}
void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const uint8_t* cls, int64_t base,
                  float beta1, float beta2, float eps, Knob decay, Knob step_size, Knob inv_sqrt_bc2, DPtr copy,
                  const float* gate, cudaStream_t s) {
  const int64_t h = vector_head(n, base, copy, {p, g, m, v});
  if (h > 0) {
    with_copy_type(copy, [&](auto* c) {
      k_adamw8<<<grid_for(h / kVec), kThreads, 0, s>>>(p, g, m, v, h / kVec, cls, base, beta1, beta2, eps, decay,
                                                       step_size, inv_sqrt_bc2, c, gate);
    });
    check_launch("k_adamw8");
  }
  LAUNCH(k_adamw, n - h, s, p + h, g + h, m + h, v + h, n - h, cls, base + h, beta1, beta2, eps, decay, step_size,
         inv_sqrt_bc2, offset(copy, h), gate);
}
void lars_update(float* p, const float* g, float* buf, int64_t n, const int32_t* cls, int64_t base, Knob lr,
                 const float* ratios, float momentum, float wd, DPtr copy, const float* gate, cudaStream_t s) {
  const int64_t h = vector_head(n, base, copy, {p, g, buf});
  if (h > 0) {
    with_copy_type(copy, [&](auto* c) {
      k_lars8<<<grid_for(h / kVec), kThreads, 0, s>>>(p, g, buf, h / kVec, cls, base, lr, ratios, momentum, wd, c,
                                                      gate);
    });
    check_launch("k_lars8");
  }
  LAUNCH(k_lars, n - h, s, p + h, g + h, buf + h, n - h, cls, base + h, lr, ratios, momentum, wd, offset(copy, h),
         gate);
}
void step_gate(float* stats, int64_t loss, int64_t bad_label, int64_t nonfinite, int64_t grad_squares, int64_t apply,
               int64_t clip, double max_norm, cudaStream_t s) {
  k_step_gate<<<1, 1, 0, s>>>(stats, loss, bad_label, nonfinite, grad_squares, apply, clip, max_norm);
  check_launch("k_step_gate");
}
void scale_by(float* y, int64_t n, const float* factor, cudaStream_t s) { LAUNCH(k_scale_by, n, s, y, n, factor); }
void lars_ratios(const float* w, const float* g, const int64_t* chunk_off, const int64_t* chunk_cnt, int chunks,
                 const int64_t* first, const int64_t* count, int segments, double* part, float trust, float wd,
                 float eps, float* out, cudaStream_t s) {
  if (segments <= 0) return;
  if (chunks > 0) {
    k_lars_chunk_sums<<<chunks, kThreads, 0, s>>>(w, g, chunk_off, chunk_cnt, part);
    check_launch("k_lars_chunk_sums");
  }
  k_lars_ratios<<<(segments + kThreads - 1) / kThreads, kThreads, 0, s>>>(part, first, count, segments, trust, wd, eps,
                                                                         out);
  check_launch("k_lars_ratios");
}

}  // namespace replica::ops::cuk
