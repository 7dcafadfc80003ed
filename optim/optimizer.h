// Optimizers over the flat parameter and gradient buffers: one fused loop per step. State lives
// in the replica's pool (tag optimizer) in fp32.
#pragma once
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/memory_pool.h"
#include "core/tensor.h"
#include "ops/backend.h"
#include "ops/nn/params.h"

namespace replica::optim {

// A contiguous range of the flat buffer and whether weight decay applies to it.
struct ParamGroup {
  int64_t offset = 0, count = 0;
  bool decay = true;
};

// The range [lo, hi) of the flat buffer an optimizer updates and keeps state for: everything by
// default (hi < 0: to the end), one replica's shard under parallel.shard (ZeRO-1/2). Every update
// is elementwise within a tensor, so a shard's update has exactly the bits of the same elements'
// update over the whole buffer.
struct ShardRange {
  int64_t lo = 0, hi = -1;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual std::string name() const = 0;
  // One update of params from grads at learning rate lr, over the optimizer's range of the flat
  // buffers: only [range_lo, range_hi) is read or changed. Each of params and grads is either whole
  // (total() elements) or the range alone (range_hi - range_lo elements, indexed from range_lo):
  // ZeRO-2 keeps only its shard of the reduced gradient, sharded masters only their shard.
  // `copy`: the model's 16-bit compute copy (nn::Model::compute_copy), whole or the range alone
  // like params, written in the update's own pass with the new parameters rounded: the bits
  // Model::refresh_compute_copy() would write after it, without another pass over the parameters.
  // Undefined (f32 training): none.
  void step(const Tensor& params, const Tensor& grads, float lr, const Tensor& copy = Tensor()) {
    if (pending_) throw Error(name() + ": step() while a gated step waits for settle()");
    update(params, grads, lr, copy, Tensor());
    steps_++;
  }
  // The same update, decided on the device: `gate` (f32 [1] on the parameters' device, the step's
  // verdict from ops::Backend::step_gate) is read when the work runs, and 0 changes nothing. So
  // the update can be queued before the host has read the verdict; once it has, settle(applied)
  // counts the step or not (the next update's step count, SGD's first momentum and AdamW's bias
  // correction depend on it). A second gated step or step() before settle() is an Error.
  void step_gated(const Tensor& params, const Tensor& grads, float lr, const Tensor& copy, const Tensor& gate) {
    if (pending_) throw Error(name() + ": a second gated step before settle()");
    update(params, grads, lr, copy, gate);
    pending_ = true;
  }
  bool pending() const { return pending_; }  // a gated step waits for settle()
  // The update's values that change from step to step (the learning rate, and what the step
  // count decides: SGD's first momentum step, AdamW's bias corrections), written into the
  // optimizer's device memory for the update after steps() applied ones (Backend::set_values: in
  // the work's order, no host wait). An update queued while they are staged for its step and lr
  // reads them there when it runs, not as numbers fixed at the call, so one captured update
  // serves every later step (train.cuda_graph stages, then replays).
  void stage(float lr) {
    if (pending_) throw Error(name() + ": stage() while a gated step waits for settle()");
    const std::vector<float> v = step_values(lr);
    backend(values_).set_values(values_, v.data(), static_cast<int64_t>(v.size()));
    staged_ = true;
    staged_lr_ = lr;
    staged_steps_ = steps_;
  }
  // A gated update captured earlier (with its values staged) was queued again by replaying it, for
  // values staged for this step at `lr`: pending as step_gated() leaves it, for settle().
  void replayed(float lr) {
    if (pending_) throw Error(name() + ": a replayed update before the last one was settled");
    if (!staged_for(lr)) throw Error(name() + ": a replayed update needs its values staged for this step (stage(lr))");
    pending_ = true;
  }
  void settle(bool applied) {
    if (!pending_) throw Error(name() + ": settle() without a gated step");
    pending_ = false;
    if (applied) steps_++;
  }
  // State tensors (momentum, moments) for checkpoints: each covers [range_lo, range_hi).
  virtual std::vector<Tensor*> state() = 0;
  int64_t steps() const { return steps_; }
  void set_steps(int64_t s) { steps_ = s; }
  int64_t range_lo() const { return lo_; }
  int64_t range_hi() const { return hi_; }
  int64_t total() const { return total_; }  // elements of the whole flat buffer
  // The backend the updates call: the parameters' device's (default), or `be` (replica bench host
  // counts and times the optimizer's calls through a wrapping backend). Not owned.
  void use_backend(ops::Backend* be) { backend_ = be; }

 protected:
  ops::Backend& backend(const Tensor& on) const { return backend_ ? *backend_ : ops::backend_for(on.device()); }
  // The update itself, for the step after steps() applied ones; it must not change steps_. Its
  // per-step values are step_values(lr), handed to the backend through step_value().
  virtual void update(const Tensor& params, const Tensor& grads, float lr, const Tensor& copy, const Tensor& gate) = 0;
  // The values that change from step to step, for the step after steps() applied ones (at most
  // kStepValues).
  virtual std::vector<float> step_values(float lr) const = 0;
  static constexpr int64_t kStepValues = 4;
  // Value i of v (= step_values(lr)): read from the device where stage(lr) put it for this step,
  // else the number itself. A stage for another lr is an Error (the update would read that one).
  ops::StepScalar step_value(const std::vector<float>& v, size_t i, float lr) const {
    if (staged_ && staged_steps_ == steps_ && staged_lr_ != lr)
      throw Error(name() + ": the update's lr " + std::to_string(lr) + " is not the lr staged for it (" +
                  std::to_string(staged_lr_) + ")");
    if (staged_for(lr)) return ops::StepScalar(v[i], values_.view(static_cast<int64_t>(i), {1}));
    return ops::StepScalar(v[i]);
  }
  bool staged_for(float lr) const { return staged_ && staged_steps_ == steps_ && staged_lr_ == lr; }
  // The device memory of the staged values (f32 [kStepValues], tag optimizer); every optimizer's
  // constructor allocates it.
  void keep_step_values(MemoryPool& pool) { values_ = Tensor::zeros(pool, {kStepValues}, DType::f32, MemTag::optimizer); }
  Tensor values_;
  bool staged_ = false;
  float staged_lr_ = 0;
  int64_t staged_steps_ = 0;
  // Fixes the range for a buffer of `total` elements; throws Error when it does not fit.
  void set_range(int64_t total, ShardRange r);
  int64_t range_size() const { return std::max<int64_t>(hi_ - lo_, 1); }  // state tensors are never empty
  // The elements [offset, offset + s.numel()) (flat coordinates) of a buffer that is whole or the
  // range alone (see step()); an Error for a buffer of any other size.
  Tensor at(const Tensor& t, int64_t offset, Shape s) const;
  // at() of the 16-bit copy step() was given, or undefined when it was given none.
  Tensor at_copy(const Tensor& copy, int64_t offset, Shape s) const { return copy.defined() ? at(copy, offset, s) : Tensor(); }
  // The range of a buffer that is whole or the range alone, as the range alone.
  Tensor in_range(const Tensor& t) const { return at(t, lo_, {std::max<int64_t>(hi_ - lo_, 0)}); }
  // The group table of the whole flat buffer (ops::ChunkClasses: one entry per kParamChunk
  // elements, u8 or i32 as the entries are) in `pool` (tag optimizer), with the range's start as
  // its base: every group of the range in one backend call.
  ops::ChunkClasses upload_classes(MemoryPool& pool, const std::vector<uint8_t>& entries) const;
  ops::ChunkClasses upload_classes(MemoryPool& pool, const std::vector<int32_t>& entries) const;
  int64_t chunks() const { return (total_ + ops::kParamChunk - 1) / ops::kParamChunk; }
  int64_t steps_ = 0;
  int64_t lo_ = 0, hi_ = 0, total_ = 0;
  ops::Backend* backend_ = nullptr;
  bool pending_ = false;  // a gated update was queued and not settled
};

struct SgdOptions {
  float momentum = 0.9f;
  bool nesterov = true;
  float weight_decay = 5e-4f;
  // coupled (PyTorch's SGD: wd * p added to the gradient, so it passes through momentum) or
  // decoupled (p -= lr * wd * p, separate from the gradient: SGDW).
  bool decoupled = false;
  // Leave batch-norm parameters and biases out of weight decay (common in large-batch recipes).
  bool no_decay_bn_bias = false;
};

class Sgd : public Optimizer {
 public:
  Sgd(const nn::ParamRegistry& reg, int64_t total, MemoryPool& pool, SgdOptions o, ShardRange r = {});
  std::string name() const override { return "sgd"; }
  std::vector<Tensor*> state() override { return {&momentum_}; }
  const SgdOptions& options() const { return o_; }

 protected:
  void update(const Tensor& params, const Tensor& grads, float lr, const Tensor& copy, const Tensor& gate) override;
  std::vector<float> step_values(float lr) const override;  // lr, decoupled decay, first

 private:
  SgdOptions o_;
  ops::ChunkClasses classes_;  // u8: 1 = decay
  Tensor momentum_;
};

struct AdamWOptions {
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  float weight_decay = 1e-2f;  // decoupled, as torch.optim.AdamW: p *= 1 - lr * wd
  bool no_decay_bn_bias = false;
};

// AdamW (Loshchilov & Hutter) with bias correction, PyTorch's update order.
class AdamW : public Optimizer {
 public:
  AdamW(const nn::ParamRegistry& reg, int64_t total, MemoryPool& pool, AdamWOptions o, ShardRange r = {});
  std::string name() const override { return "adamw"; }
  std::vector<Tensor*> state() override { return {&m_, &v_}; }

 protected:
  void update(const Tensor& params, const Tensor& grads, float lr, const Tensor& copy, const Tensor& gate) override;
  std::vector<float> step_values(float lr) const override;  // decay, step size, 1 / sqrt(bias correction 2)

 private:
  AdamWOptions o_;
  ops::ChunkClasses classes_;  // u8: 1 = decay
  Tensor m_, v_;
};

struct LarsOptions {
  float momentum = 0.9f;
  float weight_decay = 5e-5f;
  float trust_coefficient = 1e-3f;  // eta
  float eps = 1e-9f;
};

// LARS (You et al. 2017) as in the large-batch ResNet recipes: each weight tensor's step is
// scaled by eta * |w| / (|g| + wd |w|); batch-norm parameters and biases are excluded from both
// the adaptation and weight decay and take a plain momentum step. Sharded, a tensor is never split:
// its range must start and end on tensor edges (the trust ratio's norms come from its owner alone).
class Lars : public Optimizer {
 public:
  Lars(const nn::ParamRegistry& reg, int64_t total, MemoryPool& pool, LarsOptions o, ShardRange r = {});
  std::string name() const override { return "lars"; }
  std::vector<Tensor*> state() override { return {&momentum_}; }

 protected:
  void update(const Tensor& params, const Tensor& grads, float lr, const Tensor& copy, const Tensor& gate) override;
  std::vector<float> step_values(float lr) const override { return {lr}; }

 private:
  LarsOptions o_;
  struct Slot {
    int64_t offset, count;
    bool adapt;
  };
  std::vector<Slot> slots_;
  std::vector<std::pair<int64_t, int64_t>> adapted_;  // (offset from range_lo, count) of the adapted slots
  Tensor momentum_;
  Tensor ratios_;  // their trust ratios, on the device
  ops::ChunkClasses classes_;  // i32: the index in ratios_ of an adapted slot's chunks, -1 elsewhere
};

// Throws Error naming `who` unless every slot of `reg` starts on a kParamChunk boundary.
void require_chunk_aligned(const nn::ParamRegistry& reg, const std::string& who);
// Groups of the flat buffer: each slot with its decay flag, merged when neighbours agree.
std::vector<ParamGroup> make_groups(const nn::ParamRegistry& reg, bool no_decay_bn_bias);
// The parts of `groups` inside [lo, hi).
std::vector<ParamGroup> clip_groups(const std::vector<ParamGroup>& groups, int64_t lo, int64_t hi);
// Sets the group-table entries of the chunks that flat elements [offset, offset + count) touch
// to v (a slot or group starts on a chunk boundary, so the chunks are its own).
template <typename T>
void set_chunks(std::vector<T>& table, int64_t offset, int64_t count, T v) {
  const int64_t end = std::min<int64_t>((offset + count + ops::kParamChunk - 1) / ops::kParamChunk,
                                        static_cast<int64_t>(table.size()));
  for (int64_t c = offset / ops::kParamChunk; c < end; ++c) table[static_cast<size_t>(c)] = v;
}
// The u8 decay table of `groups` over `chunks` entries (ops::ChunkClasses): 1 where a group decays.
std::vector<uint8_t> decay_classes(const std::vector<ParamGroup>& groups, int64_t chunks);

// Scales grads so their global L2 norm is at most max_norm; returns the norm before clipping.
double clip_grad_norm(const Tensor& grads, double max_norm);
// The same with the norm already known (the training step reads it with its other scalars, so
// clipping costs no host synchronisation of its own).
void clip_grad_norm(const Tensor& grads, double max_norm, double norm);

}  // namespace replica::optim
