// Geometry and argument validation shared by every backend, and the host-sync counter. The
// interface names no backend: the run-time choice is ops/backend_choice.cpp, a floor above them.
#include "ops/backend.h"

#include "core/errors.h"

namespace replica::ops {

bool MixedLabels::check(const Tensor& labels, int64_t rows) {
  const bool mixed = labels.shape().rank() == 2;
  if (labels.dtype() != DType::i32 || (mixed ? labels.dim(1) != 2 : labels.shape().rank() != 1) || labels.dim(0) != rows)
    throw ShapeError("softmax_cross_entropy: " + std::to_string(rows) + " rows of logits need i32 labels [" +
                     std::to_string(rows) + "] (or [" + std::to_string(rows) + ", 2] mixed), got " + labels.str());
  if (mixed && rows % 2 != 0)
    throw ShapeError("softmax_cross_entropy: mixed labels pair rows 2k and 2k+1, but there are " +
                     std::to_string(rows) + " rows");
  return mixed;
}

MixedLabels::MixedLabels(const Tensor& labels, int64_t rows)
    : p_(labels.data<int32_t>()), mixed_(check(labels, rows)) {}

namespace {
thread_local int64_t t_host_syncs = 0;
}
int64_t host_syncs_on_this_thread() { return t_host_syncs; }
void note_host_sync() { ++t_host_syncs; }

void check_chunk_classes(const ChunkClasses& c, const Tensor& p, DType dtype, bool required, const char* who) {
  if (!c.table.defined()) {
    if (required) throw ShapeError(std::string(who) + ": needs the table of its parameter groups (ChunkClasses)");
    return;
  }
  const int64_t end = c.base + p.numel();
  if (c.table.dtype() != dtype || !(c.table.device() == p.device()) || c.base < 0 ||
      c.table.numel() * kParamChunk < end)
    throw ShapeError(std::string(who) + ": the group table " + c.table.str() + " from flat element " +
                     std::to_string(c.base) + " is not a " + dtype_name(dtype) + " table on " + p.device().str() +
                     " covering " + std::to_string(p.numel()) + " elements (" + std::to_string(kParamChunk) +
                     " per entry)");
}

namespace {
// An f32 value on p's device (a gate, a factor), or a ShapeError naming `who` and `what`.
void check_value(const Tensor& v, const Tensor& p, const char* who, const char* what) {
  if (v.dtype() != DType::f32 || v.numel() < 1 || !(v.device() == p.device()))
    throw ShapeError(std::string(who) + ": the " + what + " " + v.str() + " is not an f32 value on " + p.device().str());
}
}  // namespace

void check_gate(const Tensor& gate, const Tensor& p, const char* who) {
  if (gate.defined()) check_value(gate, p, who, "gate");
}

void check_factor(const Tensor& factor, const Tensor& y, const char* who) { check_value(factor, y, who, "factor"); }

void check_step_scalar(const StepScalar& s, const Tensor& y, const char* who) {
  if (s.at.defined()) check_value(s.at, y, who, "step value");
}

void check_copy(const Tensor& copy, const Tensor& p, const char* who) {
  if (!copy.defined()) return;
  if ((copy.dtype() != DType::f16 && copy.dtype() != DType::bf16) || copy.numel() != p.numel())
    throw ShapeError(std::string(who) + ": the compute copy " + copy.str() + " is not a 16-bit tensor the size of " +
                     p.str());
}

void check_step_gate_at(const Tensor& stats, const Backend::StepGateAt& at) {
  if (stats.dtype() != DType::f32) throw ShapeError("step_gate: expected f32 scalars, got " + stats.str());
  for (int64_t i : {at.loss, at.bad_label, at.nonfinite, at.grad_squares, at.apply, at.clip})
    if (i < 0 || i >= stats.numel()) throw ShapeError("step_gate: index " + std::to_string(i) + " is outside " + stats.str());
}

ConvGeom ConvGeom::make(const Shape& x, int64_t K, int64_t R, int64_t S, int64_t stride,
                        int64_t pad, const std::string& who, int64_t groups) {
  if (x.rank() != 4)
    throw ShapeError(who + ": expected NHWC input of rank 4, got " + x.str());
  if (stride < 1) throw ShapeError(who + ": stride must be >= 1, got " + std::to_string(stride));
  if (pad < 0) throw ShapeError(who + ": padding must be >= 0, got " + std::to_string(pad));
  if (x[0] < 1) throw ShapeError(who + ": empty batch " + x.str());
  ConvGeom g;
  g.N = x[0];
  g.H = x[1];
  g.W = x[2];
  g.C = x[3];
  g.K = K;
  g.R = R;
  g.S = S;
  g.stride = stride;
  g.pad = pad;
  if (groups < 1 || g.C % groups != 0 || K % groups != 0)
    throw ShapeError(who + ": " + std::to_string(groups) + " groups must divide the input channels (" +
                     std::to_string(g.C) + ") and the output channels (" + std::to_string(K) + ")");
  g.groups = groups;
  g.P = (g.H + 2 * pad - R) / stride + 1;
  g.Q = (g.W + 2 * pad - S) / stride + 1;
  if (g.H + 2 * pad < R || g.W + 2 * pad < S || g.P < 1 || g.Q < 1)
    throw ShapeError(who + ": input " + x.str() + " is smaller than the " + std::to_string(R) + "x" +
                     std::to_string(S) + " kernel with padding " + std::to_string(pad));
  return g;
}

PoolGeom PoolGeom::make(const Shape& x, int64_t window, int64_t stride, int64_t pad,
                        const std::string& who) {
  if (x.rank() != 4) throw ShapeError(who + ": expected NHWC input of rank 4, got " + x.str());
  if (stride < 1 || window < 1)
    throw ShapeError(who + ": window and stride must be >= 1");
  if (x[0] < 1) throw ShapeError(who + ": empty batch " + x.str());
  PoolGeom g;
  g.N = x[0];
  g.H = x[1];
  g.W = x[2];
  g.C = x[3];
  g.window = window;
  g.stride = stride;
  g.pad = pad;
  g.P = (g.H + 2 * pad - window) / stride + 1;
  g.Q = (g.W + 2 * pad - window) / stride + 1;
  if (g.P < 1 || g.Q < 1) throw ShapeError(who + ": input " + x.str() + " is smaller than the window");
  return g;
}

}  // namespace replica::ops
