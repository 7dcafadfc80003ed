// Model: a root layer plus the replica's flat parameter, gradient and buffer tensors. Building a
// model registers every parameter slot; materialize() takes the three flat buffers from the pool
// (tags params, grads, params) and points every layer's tensors into them.
#pragma once
#include <memory>
#include <string>

#include "ops/nn/layer.h"

namespace replica::nn {

class Model {
 public:
  // input: one sample's shape [H,W,C]; the root maps [N,H,W,C] to logits [N,classes].
  Model(std::string name, LayerPtr root, Shape input, int64_t classes);
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // Allocates the flat buffers from `pool` and initialises them deterministically from `seed`.
  // With a 16-bit compute dtype the layers see a 16-bit copy of the parameters (tag params) while
  // params() stays the f32 master that the optimizer updates; refresh_compute_copy() re-rounds it.
  void materialize(MemoryPool& pool, uint64_t seed, DType compute = DType::f32);
  void refresh_compute_copy();
  DType compute_dtype() const { return compute_.defined() ? compute_.dtype() : DType::f32; }
  bool materialized() const { return params_.defined(); }

  Tensor forward(Context& ctx, const Tensor& x);
  void backward(Context& ctx, const Tensor& dlogits);
  void zero_grad();
  // ZeRO-2 (parallel.shard: gradients): the flat gradient buffer goes and every slot's gradient is
  // unbound; the training step binds each to its bucket's storage while backward needs it
  // (parallel::GradientSync's release mode). grads() is undefined after it; zero_grad() a no-op.
  void release_grads();
  // Points slot `slot`'s gradient at `flat` (its elements, flat; undefined unbinds it): where a
  // released buffer's storage lives for now (GradientSync's `bind`).
  void bind_grad(int slot, const Tensor& flat);
  // Sharded fp32 masters (parallel.shard with a 16-bit compute dtype): params() keeps only the
  // master's elements [lo, hi), indexed from lo; the layers read the 16-bit copy, which stays whole
  // (refresh_compute_copy() re-rounds the shard's range only; the training step all-gathers the
  // rest). A ConfigError in f32, where the master is what the layers read.
  void shard_masters(int64_t lo, int64_t hi);
  bool masters_sharded() const { return masters_hi_ >= 0; }
  int64_t masters_lo() const { return masters_sharded() ? masters_lo_ : 0; }
  int64_t masters_hi() const { return masters_sharded() ? masters_hi_ : params_.numel(); }
  Tensor& compute_copy() { return compute_; }  // the 16-bit parameters (undefined in f32)
  // What every replica holds whole and alike: the 16-bit copy when the masters are sharded, else
  // the masters (the sharded step all-gathers it; the replica agreement check compares it).
  Tensor& replicated_params() { return masters_sharded() ? compute_ : params_; }
  // Sets the masters from `whole` (host f32, every element of the flat buffer): all of them, or the
  // shard's range when sharded, and the compute copy whole (sharded, rounded on the host, as the
  // device's cast rounds: to nearest even).
  void load_masters(const float* whole);

  Tensor& params() { return params_; }  // the f32 master copy (its shard when masters_sharded())
  Tensor& grads() { return grads_; }
  Tensor& buffers() { return buffers_; }
  const ParamRegistry& registry() const { return reg_; }
  int64_t num_params() const { return num_params_; }
  int64_t num_buffers() const { return num_buffers_; }
  const std::string& name() const { return name_; }
  const Shape& input_shape() const { return input_; }
  int64_t classes() const { return classes_; }
  Layer& root() { return *root_; }
  std::string summary() const;
  // Output shape for a batch; validates the whole model.
  Shape output_shape(int64_t batch) const;

 private:
  std::string name_;
  LayerPtr root_;
  Shape input_;
  int64_t classes_;
  ParamRegistry reg_;
  int64_t num_params_ = 0, num_buffers_ = 0;
  Tensor params_, grads_, buffers_, compute_;
  int64_t masters_lo_ = 0, masters_hi_ = -1;  // the master's range when sharded
};

}  // namespace replica::nn
