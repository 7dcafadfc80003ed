// Context of one forward/backward pass on one replica: the pool, the backend, training or eval,
// what each layer saved for backward (visible in the pool under tag `activations`), the sync-BN
// reduction and the "these gradients are final" hook the gradient synchronizer listens to.
#pragma once
#include <functional>
#include <unordered_map>
#include <vector>

#include "core/memory_pool.h"
#include "core/tensor.h"
#include "ops/backend.h"

namespace replica::nn {

class Layer;

class Context {
 public:
  Context(MemoryPool& pool, ops::Backend& backend, bool training = true)
      : pool_(pool), backend_(backend), training_(training) {}

  MemoryPool& pool() { return pool_; }
  ops::Backend& backend() { return backend_; }
  bool training() const { return training_; }
  void set_training(bool t) { training_ = t; }

  // A fresh activation-dtype tensor from the pool (tag activations unless said otherwise).
  Tensor alloc(Shape s, MemTag tag = MemTag::activations) { return Tensor::empty(pool_, s, act_dtype, tag); }
  Tensor alloc(Shape s, MemTag tag, DType dt) { return Tensor::empty(pool_, s, dt, tag); }

  // Storage type of activations and their gradients: f32, or f16/bf16 for mixed precision (the
  // kernels compute in f32 either way; 16-bit storage halves activation memory).
  DType act_dtype = DType::f32;
  // Batch norm uses its running statistics in training too ("frozen" BN: fine-tuning, and the
  // accumulation-equivalence tests); nothing updates them.
  bool bn_frozen = false;
  // Set while a checkpointed block re-runs its forward inside backward: batch norm must not
  // update its running statistics a second time.
  bool recomputing = false;

  // A context for a forward pass whose saved tensors are dropped at once (gradient
  // checkpointing): same pool, backend and settings, its own saved-tensor map.
  Context child() const {
    Context c(pool_, backend_, training_);
    c.act_dtype = act_dtype;
    c.bn_frozen = bn_frozen;
    c.recomputing = recomputing;
    c.bn_allreduce = bn_allreduce;
    return c;
  }

  // What `layer` keeps for its backward; released by `release(layer)` or `clear()`.
  std::vector<Tensor>& saved(const Layer* layer) { return saved_[layer]; }
  void release(const Layer* layer) { saved_.erase(layer); }
  void clear() { saved_.clear(); }
  size_t saved_count() const { return saved_.size(); }

  // Sync batch-norm: sums per-channel statistics across replicas. Empty = per-replica BN.
  ops::AllReduceFn bn_allreduce;
  // Called by a layer once it has finished accumulating the gradients of its parameter slots
  // [first, first + count) for this backward pass.
  std::function<void(int first, int count)> on_grads_ready;

  void grads_ready(int first, int count) {
    if (on_grads_ready && count > 0) on_grads_ready(first, count);
  }
  // Called by a layer before it writes (or adds to) the gradients of slots [first, first + count):
  // ZeRO-2 binds their storage only as backward reaches them (parallel::GradientSync::prepare).
  std::function<void(int first, int count)> on_grads_needed;

  void grads_needed(int first, int count) {
    if (on_grads_needed && count > 0) on_grads_needed(first, count);
  }

 private:
  MemoryPool& pool_;
  ops::Backend& backend_;
  bool training_;
  std::unordered_map<const Layer*, std::vector<Tensor>> saved_;
};

}  // namespace replica::nn
