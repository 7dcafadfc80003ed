// The CUDA backend's optimizer updates (SGD, AdamW, LARS and its trust ratios) and the step's
// verdict: argument checks, then the launchers of optimizers.cu.
#include <algorithm>

#include "ops/cuda/cuda_backend_impl.h"

namespace replica::ops::cuda_impl {

void CudaBackend::sgd_update(const Tensor& p, const Tensor& g, const Tensor& buf, const SgdUpdate& u,
                const ChunkClasses& classes, const Tensor& copy) {
  for (const Tensor* t : {&p, &g, &buf}) require_f32(*t, "sgd_update");
  check_chunk_classes(classes, p, DType::u8, false, "sgd_update");
  check_gate(u.gate, p, "sgd_update");
  cuk::sgd_update(p.data<float>(), g.data<float>(), buf.data<float>(), p.numel(), table<uint8_t>(classes),
                  classes.base, knob(u.lr, p, "sgd_update"), u.momentum, u.coupled_wd,
                  knob(u.decoupled_wd, p, "sgd_update"), u.nesterov, knob(u.first, p, "sgd_update"),
                  copy_ptr(copy, p, "sgd_update"), gate_ptr(u.gate), stream());
}

void CudaBackend::adamw_update(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const AdamWUpdate& u,
                  const ChunkClasses& classes, const Tensor& copy) {
  for (const Tensor* t : {&p, &g, &m, &v}) require_f32(*t, "adamw_update");
  check_chunk_classes(classes, p, DType::u8, false, "adamw_update");
  check_gate(u.gate, p, "adamw_update");
  cuk::adamw_update(p.data<float>(), g.data<float>(), m.data<float>(), v.data<float>(), p.numel(),
                    table<uint8_t>(classes), classes.base, u.beta1, u.beta2, u.eps, knob(u.decay, p, "adamw_update"),
                    knob(u.step_size, p, "adamw_update"), knob(u.inv_sqrt_bc2, p, "adamw_update"),
                    copy_ptr(copy, p, "adamw_update"), gate_ptr(u.gate), stream());
}

void CudaBackend::lars_trust_ratios(const Tensor& params, const Tensor& grads,
                       const std::vector<std::pair<int64_t, int64_t>>& segments, float trust, float wd, float eps,
                       const Tensor& ratios) {
  for (const Tensor* t : {&params, &grads, &ratios}) require_f32(*t, "lars_trust_ratios");
  const int n = static_cast<int>(segments.size());
  if (ratios.numel() < n) throw ShapeError("lars_trust_ratios: " + ratios.str() + " holds too few ratios");
  if (n == 0) return;
  for (const auto& [off, cnt] : segments)
    if (off < 0 || off + cnt > params.numel())
      throw ShapeError("lars_trust_ratios: segment past the end of " + params.str());
  // Each tensor cut into kLarsChunk-element chunks (a block each), and each tensor's run of
  // chunks: two fixed tables, kept on the device after their first upload (kept_table).
  std::vector<std::pair<int64_t, int64_t>> chunks, runs;
  for (const auto& [off, cnt] : segments) {
    const int64_t first = static_cast<int64_t>(chunks.size());
    for (int64_t a = 0; a < cnt; a += cuk::kLarsChunk) chunks.emplace_back(off + a, std::min(cuk::kLarsChunk, cnt - a));
    runs.emplace_back(first, static_cast<int64_t>(chunks.size()) - first);
  }
  const int nc = static_cast<int>(chunks.size());
  const int64_t* c = kept_table(chunks);
  const int64_t* r = kept_table(runs);
  // A table staged from this call's host vectors would sit in a captured graph and read freed
  // memory at every replay (upload_segments refuses the same): the eager steps before a capture
  // keep the step's tables, so a table not kept by then fails the capture (graphs go off, saying so).
  if ((!c || !r) && capturing())
    throw CudaError("lars_trust_ratios: a table of " + std::to_string(chunks.size()) +
                    " chunks not kept before the CUDA graph capture; the eager steps before it keep the step's tables");
  // The partial sums, and any table that could not be kept, staged in one scratch region.
  const size_t part_bytes = std::max<size_t>(1, 2 * chunks.size()) * sizeof(double);
  const size_t cb = c ? 0 : 2 * chunks.size() * sizeof(int64_t), rb = r ? 0 : 2 * runs.size() * sizeof(int64_t);
  char* base = static_cast<char*>(state().get_scratch(part_bytes + cb + rb));
  if (!c) {
    const auto oc = flatten(chunks);
    REPLICA_CUDA_CHECK(cudaMemcpyAsync(base + part_bytes, oc.data(), cb, cudaMemcpyHostToDevice, stream()));
    c = reinterpret_cast<const int64_t*>(base + part_bytes);
  }
  if (!r) {
    const auto oc = flatten(runs);
    REPLICA_CUDA_CHECK(cudaMemcpyAsync(base + part_bytes + cb, oc.data(), rb, cudaMemcpyHostToDevice, stream()));
    r = reinterpret_cast<const int64_t*>(base + part_bytes + cb);
  }
  cuk::lars_ratios(params.data<float>(), grads.data<float>(), c, c + nc, nc, r, r + n, n,
                   reinterpret_cast<double*>(base), trust, wd, eps, ratios.data<float>(), stream());
}

// The table's entries name ratios: the caller (optim::Lars) builds both, so the kernel trusts
// them (checking each entry would be a pass over the table).
void CudaBackend::lars_update(const Tensor& p, const Tensor& g, const Tensor& buf, const StepScalar& lr, const Tensor& ratios,
                 float momentum, float wd, const ChunkClasses& classes, const Tensor& copy,
                 const Tensor& gate) {
  for (const Tensor* t : {&p, &g, &buf}) require_f32(*t, "lars_update");
  check_chunk_classes(classes, p, DType::i32, true, "lars_update");
  check_gate(gate, p, "lars_update");
  if (ratios.defined()) require_f32(ratios, "lars_update");
  cuk::lars_update(p.data<float>(), g.data<float>(), buf.data<float>(), p.numel(), table<int32_t>(classes),
                   classes.base, knob(lr, p, "lars_update"), ratios.defined() ? ratios.data<float>() : nullptr,
                   momentum, wd,
                   copy_ptr(copy, p, "lars_update"), gate_ptr(gate), stream());
}

void CudaBackend::step_gate(const Tensor& stats, const StepGateAt& at, double max_norm) {
  check_step_gate_at(stats, at);
  cuk::step_gate(stats.data<float>(), at.loss, at.bad_label, at.nonfinite, at.grad_squares, at.apply, at.clip,
                 max_norm, stream());
}

}  // namespace replica::ops::cuda_impl
