// Forward and backward of the built-in layers. Each layer saves exactly what its backward reads
// and releases it as soon as backward is done, so activation memory falls during backward.
#include <cmath>

#include "core/errors.h"
#include "ops/nn/layer.h"

namespace replica::nn {

namespace {
void expect_channels(const Shape& in, int64_t c, const std::string& who) {
  if (in.rank() != 4)
    throw ShapeError(who + ": expected NHWC input [N,H,W,C], got " + in.str());
  if (in[3] != c)
    throw ShapeError(who + ": expected " + std::to_string(c) + " input channels, got input " + in.str());
  if (in[0] < 1) throw ShapeError(who + ": empty batch " + in.str());
}
}  // namespace

void Layer::backward_add(Context& ctx, const Tensor& dy, const Tensor& acc) {
  const Tensor dx = backward(ctx, dy);
  if (dx.defined()) ctx.backend().axpy(1.f, dx, acc);
}

// ---- Conv2d -----------------------------------------------------------------------------

Conv2d::Conv2d(std::string name, int64_t in_ch, int64_t out_ch, int64_t kernel, int64_t stride,
               int64_t pad, int64_t groups)
    : Layer(std::move(name)), in_(in_ch), out_(out_ch), k_(kernel), stride_(stride), pad_(pad), groups_(groups) {
  if (in_ch < 1 || out_ch < 1 || kernel < 1)
    throw ShapeError(name_ + ": channels and kernel size must be >= 1");
  if (groups < 1 || in_ch % groups != 0 || out_ch % groups != 0)
    throw ShapeError(name_ + ": " + std::to_string(groups) + " groups must divide " + std::to_string(in_ch) +
                     " input and " + std::to_string(out_ch) + " output channels");
  if (stride < 1) throw ShapeError(name_ + ": stride must be >= 1, got " + std::to_string(stride));
  if (pad < 0) throw ShapeError(name_ + ": padding must be >= 0");
}

void Conv2d::register_params(ParamRegistry& reg) {
  ParamSlot s;
  s.name = name_ + ".weight";
  s.shape = {out_, k_, k_, in_ / groups_};
  s.kind = ParamKind::weight;
  s.init = Init::kaiming_normal_fan_out;
  s.fan_in = in_ / groups_ * k_ * k_;
  s.value = &weight;
  s.grad = &weight_grad;
  slot_ = reg.add_param(s);
}

Shape Conv2d::output_shape(const Shape& in) const {
  expect_channels(in, in_, name_);
  auto g = geometry(in);
  return {g.N, g.P, g.Q, g.K};
}

Tensor Conv2d::forward(Context& ctx, const Tensor& x) {
  expect_channels(x.shape(), in_, name_);
  auto g = geometry(x.shape());
  Tensor y = ctx.alloc({g.N, g.P, g.Q, g.K});
  ctx.backend().conv2d_forward(x, weight, y, g, ctx.pool());
  if (ctx.training()) ctx.saved(this) = {x};
  return y;
}

Tensor Conv2d::backward(Context& ctx, const Tensor& dy) {
  Tensor x = ctx.saved(this).at(0);
  ctx.release(this);
  auto g = geometry(x.shape());
  ctx.grads_needed(slot_, 1);
  ctx.backend().conv2d_backward_filter(x, dy, weight_grad, g, ctx.pool());
  ctx.grads_ready(slot_, 1);
  if (!input_grad_) return {};
  Tensor dx = ctx.alloc(x.shape());
  ctx.backend().conv2d_backward_data(dy, weight, dx, g, ctx.pool(), false);
  return dx;
}

void Conv2d::backward_add(Context& ctx, const Tensor& dy, const Tensor& acc) {
  Tensor x = ctx.saved(this).at(0);
  ctx.release(this);
  auto g = geometry(x.shape());
  if (acc.shape() != x.shape())
    throw ShapeError(name_ + ": the gradient to add into is " + acc.shape().str() + ", the input " + x.shape().str());
  ctx.grads_needed(slot_, 1);
  ctx.backend().conv2d_backward_filter(x, dy, weight_grad, g, ctx.pool());
  ctx.grads_ready(slot_, 1);
  if (input_grad_) ctx.backend().conv2d_backward_data(dy, weight, acc, g, ctx.pool(), true);
}

// ---- BatchNorm2d ------------------------------------------------------------------------

BatchNorm2d::BatchNorm2d(std::string name, int64_t channels, float momentum, float eps, bool zero_gamma, bool relu)
    : Layer(std::move(name)), c_(channels), momentum_(momentum), eps_(eps), zero_gamma_(zero_gamma), relu_(relu) {
  if (channels < 1) throw ShapeError(name_ + ": channels must be >= 1");
}

void BatchNorm2d::register_params(ParamRegistry& reg) {
  ParamSlot g;
  g.name = name_ + ".weight";
  g.shape = {c_};
  g.kind = ParamKind::bn_gamma;
  g.init = zero_gamma_ ? Init::zeros : Init::ones;
  g.value = &gamma;
  g.grad = &gamma_grad;
  slot_ = reg.add_param(g);
  ParamSlot b;
  b.name = name_ + ".bias";
  b.shape = {c_};
  b.kind = ParamKind::bn_beta;
  b.init = Init::zeros;
  b.value = &beta;
  b.grad = &beta_grad;
  reg.add_param(b);
  reg.add_buffer({name_ + ".running_mean", {c_}, 0.f, 0, &running_mean});
  reg.add_buffer({name_ + ".running_var", {c_}, 1.f, 0, &running_var});
}

Shape BatchNorm2d::output_shape(const Shape& in) const {
  if (in.rank() < 2 || in[in.rank() - 1] != c_)
    throw ShapeError(name_ + ": expected " + std::to_string(c_) + " channels last, got " + in.str());
  return in;
}

Tensor BatchNorm2d::forward(Context& ctx, const Tensor& x) { return run(ctx, x, Tensor(), relu_); }

Tensor BatchNorm2d::forward_join(Context& ctx, const Tensor& x, const Tensor& residual) {
  if (residual.shape() != x.shape())
    throw ShapeError(name_ + ": the residual " + residual.shape().str() + " does not match the input " +
                     x.shape().str());
  return run(ctx, x, residual, true);
}

Tensor BatchNorm2d::run(Context& ctx, const Tensor& x, const Tensor& residual, bool relu) {
  output_shape(x.shape());
  Tensor y = ctx.alloc(x.shape());
  // What backward needs: x, the statistics, and the output when a ReLU ends the pass (its mask).
  if (!ctx.training() || ctx.bn_frozen) {
    ctx.backend().batchnorm_forward_eval(x, gamma, beta, y, running_mean, running_var, eps_, residual, relu);
    if (ctx.training()) {
      // Frozen BN: y is an affine map of x with the running statistics; backward needs those.
      Tensor invstd = ctx.alloc({c_}, MemTag::activations, DType::f32);
      ctx.backend().rsqrt_eps(running_var, invstd, eps_);
      ctx.saved(this) = {x, running_mean, invstd, relu ? y : Tensor()};
    }
    return y;
  }
  Tensor mean = ctx.alloc({c_}, MemTag::activations, DType::f32);
  Tensor invstd = ctx.alloc({c_}, MemTag::activations, DType::f32);
  // A recomputation (gradient checkpointing) must not move the running statistics again.
  ctx.backend().batchnorm_forward_train(x, gamma, beta, y, mean, invstd, running_mean, running_var,
                                        ctx.recomputing ? 0.f : momentum_, eps_, ctx.bn_allreduce, residual, relu);
  ctx.saved(this) = {x, mean, invstd, relu ? y : Tensor()};
  return y;
}

Tensor BatchNorm2d::backward(Context& ctx, const Tensor& dy) {
  auto s = ctx.saved(this);
  ctx.release(this);
  Tensor dx = ctx.alloc(s[0].shape());
  ctx.grads_needed(slot_, 2);
  if (ctx.bn_frozen)
    ctx.backend().batchnorm_backward_frozen(dy, s[0], gamma, s[1], s[2], dx, gamma_grad, beta_grad, s[3]);
  else
    ctx.backend().batchnorm_backward(dy, s[0], gamma, s[1], s[2], dx, gamma_grad, beta_grad, ctx.bn_allreduce, s[3]);
  ctx.grads_ready(slot_, 2);
  return dx;
}

// ---- ReLU, pooling ----------------------------------------------------------------------

Tensor ReLU::forward(Context& ctx, const Tensor& x) {
  Tensor y = inplace_ ? x : ctx.alloc(x.shape());
  ctx.backend().relu_forward(x, y);
  if (ctx.training()) ctx.saved(this) = {y};
  return y;
}

Tensor ReLU::backward(Context& ctx, const Tensor& dy) {
  Tensor y = ctx.saved(this).at(0);
  ctx.release(this);
  // An in-place ReLU also masks dy in place (its caller handed dy over); otherwise dy may be
  // read again by the caller (a residual shortcut), so write a new tensor.
  Tensor dx = inplace_ ? dy : ctx.alloc(dy.shape());
  ctx.backend().relu_backward(y, dy, dx);
  return dx;
}

Shape MaxPool2d::output_shape(const Shape& in) const {
  auto g = ops::PoolGeom::make(in, window_, stride_, pad_, name_);
  return {g.N, g.P, g.Q, g.C};
}

Tensor MaxPool2d::forward(Context& ctx, const Tensor& x) {
  auto g = ops::PoolGeom::make(x.shape(), window_, stride_, pad_, name_);
  Tensor y = ctx.alloc({g.N, g.P, g.Q, g.C});
  Tensor arg = ctx.alloc({g.N, g.P, g.Q, g.C}, MemTag::activations, DType::i32);
  ctx.backend().maxpool_forward(x, y, arg, g);
  if (ctx.training()) ctx.saved(this) = {arg, Tensor::wrap(nullptr, x.shape(), DType::f32, x.device())};
  return y;
}

Tensor MaxPool2d::backward(Context& ctx, const Tensor& dy) {
  auto s = ctx.saved(this);
  ctx.release(this);
  Shape in = s[1].shape();  // only the input's shape was kept, not its data
  auto g = ops::PoolGeom::make(in, window_, stride_, pad_, name_);
  Tensor dx = ctx.alloc(in);
  ctx.backend().maxpool_backward(dy, s[0], dx, g);
  return dx;
}

Shape GlobalAvgPool::output_shape(const Shape& in) const {
  if (in.rank() != 4) throw ShapeError(name_ + ": expected NHWC input, got " + in.str());
  return {in[0], in[3]};
}

Tensor GlobalAvgPool::forward(Context& ctx, const Tensor& x) {
  Tensor y = ctx.alloc(output_shape(x.shape()));
  ctx.backend().global_avgpool_forward(x, y);
  if (ctx.training()) ctx.saved(this) = {Tensor::wrap(nullptr, x.shape(), DType::f32, x.device())};
  return y;
}

Tensor GlobalAvgPool::backward(Context& ctx, const Tensor& dy) {
  Shape in = ctx.saved(this).at(0).shape();
  ctx.release(this);
  Tensor dx = ctx.alloc(in);
  ctx.backend().global_avgpool_backward(dy, dx);
  return dx;
}

// ---- Linear -----------------------------------------------------------------------------

Linear::Linear(std::string name, int64_t in, int64_t out) : Layer(std::move(name)), in_(in), out_(out) {
  if (in < 1 || out < 1) throw ShapeError(name_ + ": features must be >= 1");
}

void Linear::register_params(ParamRegistry& reg) {
  ParamSlot w;
  w.name = name_ + ".weight";
  w.shape = {out_, in_};
  w.kind = ParamKind::weight;
  w.init = Init::kaiming_uniform_linear;
  w.fan_in = in_;
  w.value = &weight;
  w.grad = &weight_grad;
  slot_ = reg.add_param(w);
  ParamSlot b;
  b.name = name_ + ".bias";
  b.shape = {out_};
  b.kind = ParamKind::bias;
  b.init = Init::linear_bias;
  b.fan_in = in_;
  b.value = &bias;
  b.grad = &bias_grad;
  reg.add_param(b);
}

Shape Linear::output_shape(const Shape& in) const {
  if (in.rank() < 1 || in[0] < 1) throw ShapeError(name_ + ": empty batch " + in.str());
  if (in.numel() / in[0] != in_)
    throw ShapeError(name_ + ": expected " + std::to_string(in_) + " input features, got " + in.str());
  return {in[0], out_};
}

Tensor Linear::forward(Context& ctx, const Tensor& x) {
  Tensor y = ctx.alloc(output_shape(x.shape()));
  ctx.backend().linear_forward(x, weight, bias, y);
  if (ctx.training()) ctx.saved(this) = {x};
  return y;
}

Tensor Linear::backward(Context& ctx, const Tensor& dy) {
  Tensor x = ctx.saved(this).at(0);
  ctx.release(this);
  Tensor dx = ctx.alloc(x.shape());
  ctx.grads_needed(slot_, 2);
  ctx.backend().linear_backward(x, weight, dy, dx, weight_grad, bias_grad);
  ctx.grads_ready(slot_, 2);
  return dx;
}

// ---- containers -------------------------------------------------------------------------

Tensor Sequential::forward(Context& ctx, const Tensor& x) { return forward_range(ctx, x, 0, layers_.size()); }

Tensor Sequential::backward(Context& ctx, const Tensor& dy) { return backward_range(ctx, dy, 0, layers_.size()); }

Tensor Sequential::forward_range(Context& ctx, const Tensor& x, size_t first, size_t last) {
  Tensor h = x;
  for (size_t i = first; i < last; ++i) {
    AllocationSite site(layers_[i]->name().c_str());  // what each layer allocates is attributed to it
    h = layers_[i]->forward(ctx, h);
  }
  return h;
}

Tensor Sequential::backward_range(Context& ctx, const Tensor& dy, size_t first, size_t last) {
  Tensor g = dy;
  for (size_t i = last; i-- > first;) {
    AllocationSite site(layers_[i]->name().c_str());
    g = layers_[i]->backward(ctx, g);
  }
  return g;
}

void Sequential::register_params(ParamRegistry& reg) {
  for (auto& l : layers_) l->register_params(reg);
}

Shape Sequential::output_shape(const Shape& in) const {
  Shape s = in;
  for (auto& l : layers_) s = l->output_shape(s);
  return s;
}

void Sequential::visit(const std::function<void(Layer&)>& fn) {
  fn(*this);
  for (auto& l : layers_) l->visit(fn);
}

Residual::Residual(std::string name, std::unique_ptr<Sequential> main, std::unique_ptr<Sequential> shortcut)
    : Layer(std::move(name)), main_(std::move(main)), shortcut_(std::move(shortcut)) {}

Tensor Residual::forward(Context& ctx, const Tensor& x) {
  if (recompute_ && ctx.training() && !ctx.recomputing) {
    Context scratch = ctx.child();  // what the inside saves dies with it
    Tensor y = forward_impl(scratch, x);
    ctx.saved(this) = {x};
    return y;
  }
  return forward_impl(ctx, x);
}

BatchNorm2d* Residual::fused_join() const {
  if (!fuse_join_ || main_->size() < 2) return nullptr;
  auto* bn = dynamic_cast<BatchNorm2d*>(&main_->at(main_->size() - 1));
  return bn && !bn->relu() ? bn : nullptr;
}

Tensor Residual::forward_impl(Context& ctx, const Tensor& x) {
  if (BatchNorm2d* join = fused_join()) {
    // The main path up to its last batch norm, the shortcut, then batch norm + add + ReLU in one
    // pass (the batch norm saves the output, whose sign is the ReLU's mask).
    const size_t n = main_->size();
    Tensor h = main_->forward_range(ctx, x, 0, n - 1);
    Tensor b = shortcut_ ? shortcut_->forward(ctx, x) : x;
    if (h.shape() != b.shape())
      throw ShapeError(name_ + ": main path gives " + h.shape().str() + " but the shortcut gives " +
                       b.shape().str() + "; add a projection shortcut");
    AllocationSite site(join->name().c_str());
    return join->forward_join(ctx, h, b);
  }
  Tensor a = main_->forward(ctx, x);
  Tensor b = shortcut_ ? shortcut_->forward(ctx, x) : x;
  if (a.shape() != b.shape())
    throw ShapeError(name_ + ": main path gives " + a.shape().str() + " but the shortcut gives " +
                     b.shape().str() + "; add a projection shortcut");
  Tensor y = ctx.alloc(a.shape());
  ctx.backend().add_relu(a, b, y);
  if (ctx.training()) ctx.saved(this) = {y};
  return y;
}

Tensor Residual::backward(Context& ctx, const Tensor& dy) {
  if (recompute_) {
    Tensor x = ctx.saved(this).at(0);
    ctx.release(this);
    ctx.recomputing = true;
    forward_impl(ctx, x);  // saves what backward needs, as an uncheckpointed forward would
    ctx.recomputing = false;
  }
  if (fused_join()) {
    // The join's backward masks dy in place with the ReLU: dy is then the gradient of the sum,
    // which is the shortcut's gradient as it stands. The main path's first layer adds its input
    // gradient into the shortcut's (a convolution: cuDNN's beta = 1), so no add-backward pass.
    const size_t n = main_->size();
    Tensor g = main_->backward_range(ctx, dy, 1, n);
    Tensor dx = shortcut_ ? shortcut_->backward(ctx, dy) : dy;
    AllocationSite site(main_->at(0).name().c_str());
    main_->at(0).backward_add(ctx, g, dx);
    return dx;
  }
  Tensor y = ctx.saved(this).at(0);
  ctx.release(this);
  ctx.backend().relu_backward(y, dy, dy);
  y = Tensor();
  // The shortcut still needs dy: a main path that would mask it in place (ending in a batch norm
  // with a ReLU, an in-place ReLU) gets a copy.
  Tensor dm = dy;
  if (main_->consumes_dy()) {
    dm = ctx.alloc(dy.shape());
    ctx.backend().cast(dy, dm);
  }
  Tensor dx = main_->backward(ctx, dm);
  dm = Tensor();
  if (shortcut_) {
    Tensor ds = shortcut_->backward(ctx, dy);
    ctx.backend().axpy(1.f, ds, dx);
  } else {
    ctx.backend().axpy(1.f, dy, dx);
  }
  return dx;
}

void Residual::register_params(ParamRegistry& reg) {
  main_->register_params(reg);
  if (shortcut_) shortcut_->register_params(reg);
}

Shape Residual::output_shape(const Shape& in) const {
  Shape a = main_->output_shape(in);
  Shape b = shortcut_ ? shortcut_->output_shape(in) : in;
  if (a != b)
    throw ShapeError(name_ + ": main path gives " + a.str() + " but the shortcut gives " + b.str() +
                     "; add a projection shortcut");
  return a;
}

void Residual::visit(const std::function<void(Layer&)>& fn) {
  fn(*this);
  main_->visit(fn);
  if (shortcut_) shortcut_->visit(fn);
}

namespace {
Shape walk_convs(Layer& l, Shape in, std::vector<ops::ConvGeom>& out) {
  if (auto* c = dynamic_cast<Conv2d*>(&l)) {
    const Shape y = c->output_shape(in);
    out.push_back(ops::ConvGeom::make(in, y[3], c->kernel(), c->kernel(), c->stride(), c->pad(), c->name(), c->groups()));
    return y;
  }
  if (auto* q = dynamic_cast<Sequential*>(&l)) {
    for (size_t i = 0; i < q->size(); ++i) in = walk_convs(q->at(i), in, out);
    return in;
  }
  if (auto* r = dynamic_cast<Residual*>(&l)) {
    const Shape y = r->output_shape(in);
    walk_convs(r->main(), in, out);
    if (r->shortcut()) walk_convs(*r->shortcut(), in, out);
    return y;
  }
  return l.output_shape(in);
}
}  // namespace

std::vector<ops::ConvGeom> conv_geometries(Layer& root, const Shape& in) {
  std::vector<ops::ConvGeom> out;
  walk_convs(root, in, out);
  return out;
}

}  // namespace replica::nn
