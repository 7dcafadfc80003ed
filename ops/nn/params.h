// Parameters as views into one flat buffer per replica (and gradients into another), so a whole
// bucket of gradients is one contiguous all-reduce and the optimizer is one fused loop.
#pragma once
#include <string>
#include <vector>

#include "core/memory_pool.h"
#include "core/tensor.h"

namespace replica::nn {

enum class ParamKind { weight, bias, bn_gamma, bn_beta };
enum class Init { kaiming_normal_fan_out, kaiming_uniform_linear, zeros, ones, linear_bias };

// One parameter tensor: where it lives in the flat buffers and how to initialise it.
struct ParamSlot {
  std::string name;
  Shape shape;
  ParamKind kind = ParamKind::weight;
  Init init = Init::zeros;
  int64_t fan_in = 1;   // for the linear initialisations
  int64_t offset = 0;   // elements into the flat buffer
  Tensor* value = nullptr;
  Tensor* grad = nullptr;
};

// Non-trainable state (batch-norm running statistics) in its own flat buffer.
struct BufferSlot {
  std::string name;
  Shape shape;
  float init = 0.f;
  int64_t offset = 0;
  Tensor* value = nullptr;
};

// Collects slots while a model is built, then lays the flat buffers out.
class ParamRegistry {
 public:
  int add_param(ParamSlot slot) {
    params_.push_back(std::move(slot));
    return static_cast<int>(params_.size()) - 1;
  }
  void add_buffer(BufferSlot slot) { buffers_.push_back(std::move(slot)); }
  std::vector<ParamSlot>& params() { return params_; }
  std::vector<BufferSlot>& buffers() { return buffers_; }
  const std::vector<ParamSlot>& params() const { return params_; }
  const std::vector<BufferSlot>& buffers() const { return buffers_; }

 private:
  std::vector<ParamSlot> params_;
  std::vector<BufferSlot> buffers_;
};

}  // namespace replica::nn
