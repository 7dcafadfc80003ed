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
  void materialize(MemoryPool& pool, uint64_t seed);
  bool materialized() const { return params_.defined(); }

  Tensor forward(Context& ctx, const Tensor& x);
  void backward(Context& ctx, const Tensor& dlogits);
  void zero_grad();

  Tensor& params() { return params_; }
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
  Tensor params_, grads_, buffers_;
};

}  // namespace replica::nn
