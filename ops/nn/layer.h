// Layer: explicit forward(ctx, x) and backward(ctx, dy). Parameters are views into the model's
// flat buffers; backward accumulates (+=) into gradients so micro-batches add up, and reports
// finished gradient slots through ctx.grads_ready so buckets can start their all-reduce.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ops/nn/context.h"
#include "ops/nn/params.h"

namespace replica::nn {

class Layer {
 public:
  explicit Layer(std::string name) : name_(std::move(name)) {}
  virtual ~Layer() = default;
  const std::string& name() const { return name_; }

  virtual Tensor forward(Context& ctx, const Tensor& x) = 0;
  // Returns the gradient with respect to the input (undefined when not needed).
  virtual Tensor backward(Context& ctx, const Tensor& dy) = 0;
  // The same, adding the input gradient into `acc` (same shape as the input) instead of returning
  // it: a residual block's main path adds into its shortcut's gradient. This default computes it
  // and adds; a convolution lets its kernel add (no extra pass).
  virtual void backward_add(Context& ctx, const Tensor& dy, const Tensor& acc);
  // Whether backward overwrites the dy it is handed (a ReLU's mask applied in place): a caller
  // that reads dy again afterwards (a residual block's shortcut) must hand it a copy.
  virtual bool consumes_dy() const { return false; }
  // Declares parameters and buffers (containers recurse in forward order).
  virtual void register_params(ParamRegistry&) {}
  // The output shape for an input shape; throws ShapeError naming the layer if they do not fit.
  virtual Shape output_shape(const Shape& in) const = 0;
  // Visits this layer and its children, depth first in forward order.
  virtual void visit(const std::function<void(Layer&)>& fn) { fn(*this); }

 protected:
  std::string name_;
};

using LayerPtr = std::unique_ptr<Layer>;

class Conv2d : public Layer {
 public:
  // groups > 1: a grouped convolution (ResNeXt), filters [out, k, k, in / groups].
  Conv2d(std::string name, int64_t in_ch, int64_t out_ch, int64_t kernel, int64_t stride, int64_t pad,
         int64_t groups = 1);
  Tensor forward(Context& ctx, const Tensor& x) override;
  Tensor backward(Context& ctx, const Tensor& dy) override;
  void backward_add(Context& ctx, const Tensor& dy, const Tensor& acc) override;
  void register_params(ParamRegistry& reg) override;
  Shape output_shape(const Shape& in) const override;
  // The first layer of a model need not compute the gradient of the images.
  void set_input_grad(bool on) { input_grad_ = on; }
  int64_t kernel() const { return k_; }
  int64_t stride() const { return stride_; }
  int64_t pad() const { return pad_; }
  int64_t groups() const { return groups_; }
  Tensor weight, weight_grad;

 private:
  ops::ConvGeom geometry(const Shape& x) const {
    return ops::ConvGeom::make(x, out_, k_, k_, stride_, pad_, name_, groups_);
  }
  int64_t in_, out_, k_, stride_, pad_, groups_;
  bool input_grad_ = true;
  int slot_ = -1;
};

class BatchNorm2d : public Layer {
 public:
  // relu: a ReLU follows, fused into batch norm's passes (forward and backward), as cuDNN's
  // BN-activation fusion; its output is what backward masks with.
  BatchNorm2d(std::string name, int64_t channels, float momentum = 0.1f, float eps = 1e-5f,
              bool zero_gamma = false, bool relu = false);
  Tensor forward(Context& ctx, const Tensor& x) override;
  // y = max(bn(x) + residual, 0) in one pass: a residual block's join (Residual calls it on its
  // main path's last batch norm). backward then masks dy in place with the ReLU, so afterwards dy
  // holds the gradient of the sum: the residual's gradient.
  Tensor forward_join(Context& ctx, const Tensor& x, const Tensor& residual);
  Tensor backward(Context& ctx, const Tensor& dy) override;
  void register_params(ParamRegistry& reg) override;
  Shape output_shape(const Shape& in) const override;
  bool relu() const { return relu_; }
  bool consumes_dy() const override { return relu_; }
  Tensor gamma, beta, gamma_grad, beta_grad, running_mean, running_var;

 private:
  Tensor run(Context& ctx, const Tensor& x, const Tensor& residual, bool relu);
  int64_t c_;
  float momentum_, eps_;
  bool zero_gamma_, relu_;
  int slot_ = -1;
};

class ReLU : public Layer {
 public:
  // In place: overwrites its input. Safe after batch norm or an add, whose outputs nobody saves.
  explicit ReLU(std::string name, bool inplace = false) : Layer(std::move(name)), inplace_(inplace) {}
  Tensor forward(Context& ctx, const Tensor& x) override;
  Tensor backward(Context& ctx, const Tensor& dy) override;
  Shape output_shape(const Shape& in) const override { return in; }
  bool consumes_dy() const override { return inplace_; }

 private:
  bool inplace_;
};

class MaxPool2d : public Layer {
 public:
  MaxPool2d(std::string name, int64_t window, int64_t stride, int64_t pad)
      : Layer(std::move(name)), window_(window), stride_(stride), pad_(pad) {}
  Tensor forward(Context& ctx, const Tensor& x) override;
  Tensor backward(Context& ctx, const Tensor& dy) override;
  Shape output_shape(const Shape& in) const override;

 private:
  int64_t window_, stride_, pad_;
};

// [N,H,W,C] -> [N,C]
class GlobalAvgPool : public Layer {
 public:
  explicit GlobalAvgPool(std::string name) : Layer(std::move(name)) {}
  Tensor forward(Context& ctx, const Tensor& x) override;
  Tensor backward(Context& ctx, const Tensor& dy) override;
  Shape output_shape(const Shape& in) const override;
};

// [N, in] (or anything flattening to it) -> [N, out], with bias.
class Linear : public Layer {
 public:
  Linear(std::string name, int64_t in, int64_t out);
  Tensor forward(Context& ctx, const Tensor& x) override;
  Tensor backward(Context& ctx, const Tensor& dy) override;
  void register_params(ParamRegistry& reg) override;
  Shape output_shape(const Shape& in) const override;
  Tensor weight, bias, weight_grad, bias_grad;

 private:
  int64_t in_, out_;
  int slot_ = -1;
};

class Sequential : public Layer {
 public:
  explicit Sequential(std::string name) : Layer(std::move(name)) {}
  Sequential& add(LayerPtr layer) {
    layers_.push_back(std::move(layer));
    return *this;
  }
  template <typename L, typename... Args>
  L& emplace(Args&&... args) {
    auto p = std::make_unique<L>(std::forward<Args>(args)...);
    L& ref = *p;
    layers_.push_back(std::move(p));
    return ref;
  }
  Tensor forward(Context& ctx, const Tensor& x) override;
  Tensor backward(Context& ctx, const Tensor& dy) override;
  void register_params(ParamRegistry& reg) override;
  Shape output_shape(const Shape& in) const override;
  void visit(const std::function<void(Layer&)>& fn) override;
  bool consumes_dy() const override { return !layers_.empty() && layers_.back()->consumes_dy(); }
  // Layers [first, last) forward; backward runs them from last - 1 down to first (a residual
  // block runs its main path in parts to fuse its join).
  Tensor forward_range(Context& ctx, const Tensor& x, size_t first, size_t last);
  Tensor backward_range(Context& ctx, const Tensor& dy, size_t first, size_t last);
  size_t size() const { return layers_.size(); }
  Layer& at(size_t i) { return *layers_[i]; }

 private:
  std::vector<LayerPtr> layers_;
};

// relu(main(x) + shortcut(x)); an empty shortcut is the identity. When the main path ends in a
// batch norm without a ReLU of its own (every ResNet block), the join is fused: that batch norm,
// the add and the ReLU are one pass forward, and backward has no ReLU or add pass of its own (the
// batch norm masks the gradient in place; the main path's first layer adds into the shortcut's
// gradient). The unfused form is kept for other main paths and for comparison
// (set_fused_join(false)); in f32 on the CPU the two give the same bits.
class Residual : public Layer {
 public:
  Residual(std::string name, std::unique_ptr<Sequential> main, std::unique_ptr<Sequential> shortcut);
  Tensor forward(Context& ctx, const Tensor& x) override;
  Tensor backward(Context& ctx, const Tensor& dy) override;
  void register_params(ParamRegistry& reg) override;
  Shape output_shape(const Shape& in) const override;
  void visit(const std::function<void(Layer&)>& fn) override;
  Sequential& main() { return *main_; }
  Sequential* shortcut() { return shortcut_.get(); }  // null: the identity
  // Gradient checkpointing: keep only the block's input after forward and recompute the inside
  // during backward (bit-identical gradients, activation memory of one block at a time).
  void set_recompute(bool on) { recompute_ = on; }
  bool recompute() const { return recompute_; }
  void set_fused_join(bool on) { fuse_join_ = on; }
  bool consumes_dy() const override { return true; }  // the join's ReLU masks dy in place, either form
  // The main path's last batch norm when the join is fused, else null.
  BatchNorm2d* fused_join() const;

 private:
  Tensor forward_impl(Context& ctx, const Tensor& x);
  std::unique_ptr<Sequential> main_, shortcut_;
  bool recompute_ = false, fuse_join_ = true;
};

// Every convolution of the layer tree under `root` with the geometry it runs at for input `in`
// (shape inference through Sequential and Residual blocks, in forward order; duplicates kept):
// what per-layer benchmarks and the CPU kernels' calibration (ops/cpu/tuning.h) time.
std::vector<ops::ConvGeom> conv_geometries(Layer& root, const Shape& in);

}  // namespace replica::nn
