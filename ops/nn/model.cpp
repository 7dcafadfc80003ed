// Model: flat buffer layout and deterministic initialisation (torchvision's ResNet recipe:
// Kaiming-normal fan-out for convolutions, PyTorch's default uniform for linear layers).
#include "ops/nn/model.h"

#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <vector>

#include "core/errors.h"
#include "ops/backend.h"

namespace replica::nn {

namespace {
// Every slot starts at a 16-float boundary so each parameter is SIMD-aligned in the flat buffer,
// and each kParamChunk-element chunk belongs to one slot (the optimizers' ChunkClasses).
static_assert(ops::kParamChunk == 16, "slots are aligned to the optimizers' chunk");
int64_t align16(int64_t n) { return (n + 15) & ~int64_t(15); }
}  // namespace

Model::Model(std::string name, LayerPtr root, Shape input, int64_t classes)
    : name_(std::move(name)), root_(std::move(root)), input_(input), classes_(classes) {
  root_->register_params(reg_);
  int64_t off = 0;
  for (auto& p : reg_.params()) {
    p.offset = off;
    off += align16(p.shape.numel());
  }
  num_params_ = off;
  off = 0;
  for (auto& b : reg_.buffers()) {
    b.offset = off;
    off += align16(b.shape.numel());
  }
  num_buffers_ = off;
  Shape out = output_shape(1);
  if (out.rank() != 2 || out[1] != classes_)
    throw ShapeError(name_ + ": the model ends in " + out.str() + ", expected [N," +
                     std::to_string(classes_) + "]");
}

Shape Model::output_shape(int64_t batch) const {
  Shape in{batch, input_[0], input_[1], input_[2]};
  return root_->output_shape(in);
}

void Model::materialize(MemoryPool& pool, uint64_t seed, DType compute) {
  if (compute != DType::f32 && compute != DType::f16 && compute != DType::bf16)
    throw ConfigError(name_ + ": compute dtype must be f32, f16 or bf16");
  // params and buffers are written whole from the host below; only the gradients start zeroed.
  params_ = Tensor::empty(pool, {std::max<int64_t>(num_params_, 1)}, DType::f32, MemTag::params);
  grads_ = Tensor::zeros(pool, {std::max<int64_t>(num_params_, 1)}, DType::f32, MemTag::grads);
  buffers_ = Tensor::empty(pool, {std::max<int64_t>(num_buffers_, 1)}, DType::f32, MemTag::params);
  // Initialised on the host (the same numbers on every device kind) and copied in once.
  std::vector<float> host_params(static_cast<size_t>(params_.numel()), 0.f);
  std::vector<float> host_buffers(static_cast<size_t>(buffers_.numel()), 0.f);
  int index = 0;
  for (auto& p : reg_.params()) {
    *p.value = params_.view(p.offset, p.shape);
    *p.grad = grads_.view(p.offset, p.shape);
    float* v = host_params.data() + p.offset;
    const int64_t n = p.shape.numel();
    std::mt19937_64 rng(seed * 1000003ull + static_cast<uint64_t>(index++));
    switch (p.init) {
      case Init::zeros: std::fill_n(v, n, 0.f); break;
      case Init::ones: std::fill_n(v, n, 1.f); break;
      case Init::kaiming_normal_fan_out: {
        // fan_out = K * R * S for KRSC filters; gain sqrt(2) for ReLU.
        int64_t fan_out = p.shape[0] * (p.shape.rank() == 4 ? p.shape[1] * p.shape[2] : 1);
        std::normal_distribution<float> d(0.f, std::sqrt(2.f / static_cast<float>(fan_out)));
        for (int64_t i = 0; i < n; ++i) v[i] = d(rng);
        break;
      }
      case Init::kaiming_uniform_linear:
      case Init::linear_bias: {
        float bound = 1.f / std::sqrt(static_cast<float>(p.fan_in));
        std::uniform_real_distribution<float> d(-bound, bound);
        for (int64_t i = 0; i < n; ++i) v[i] = d(rng);
        break;
      }
    }
  }
  for (auto& b : reg_.buffers()) {
    *b.value = buffers_.view(b.offset, b.shape);
    std::fill_n(host_buffers.data() + b.offset, b.shape.numel(), b.init);
  }
  tensor_from_bytes(params_, host_params.data(), host_params.size() * sizeof(float));
  tensor_from_bytes(buffers_, host_buffers.data(), host_buffers.size() * sizeof(float));
  if (compute != DType::f32) {
    compute_ = Tensor::empty(pool, params_.shape(), compute, MemTag::params);
    for (auto& p : reg_.params()) *p.value = compute_.view(p.offset, p.shape);
    refresh_compute_copy();
  }
}

void Model::refresh_compute_copy() {
  if (!compute_.defined()) return;
  auto& be = ops::backend_for(params_.device());
  if (!masters_sharded()) return be.cast(params_, compute_);
  const int64_t n = masters_hi_ - masters_lo_;
  if (n > 0) be.cast(params_.view(0, {n}), compute_.view(masters_lo_, {n}));
}

void Model::load_masters(const float* whole) {
  if (!masters_sharded()) {
    tensor_from_bytes(params_, whole, params_.nbytes());
    return refresh_compute_copy();
  }
  const int64_t n = masters_hi_ - masters_lo_;
  if (n > 0) tensor_from_bytes(params_.view(0, {n}), whole + masters_lo_, static_cast<size_t>(n) * sizeof(float));
  std::vector<char> rounded(compute_.nbytes());
  convert(whole, DType::f32, rounded.data(), compute_.dtype(), static_cast<size_t>(compute_.numel()));
  tensor_from_bytes(compute_, rounded.data(), rounded.size());
}

void Model::shard_masters(int64_t lo, int64_t hi) {
  if (!compute_.defined())
    throw ConfigError(name_ + ": fp32 master weights are sharded only beside a 16-bit compute copy (train.precision "
                      "fp16 or bf16); in fp32 the layers read the masters themselves");
  if (masters_sharded() || lo < 0 || lo > hi || hi > params_.numel())
    throw Error(name_ + ": cannot shard the masters to [" + std::to_string(lo) + ", " + std::to_string(hi) + ") of " +
                std::to_string(params_.numel()) + (masters_sharded() ? " (sharded already)" : ""));
  Tensor mine = Tensor::empty(*params_.pool(), {std::max<int64_t>(hi - lo, 1)}, DType::f32, MemTag::params);
  if (hi > lo) copy_tensor(params_.view(lo, {hi - lo}), mine.view(0, {hi - lo}));
  params_ = mine;  // the whole master goes back to the pool
  masters_lo_ = lo;
  masters_hi_ = hi;
}

Tensor Model::forward(Context& ctx, const Tensor& x) {
  if (!materialized()) throw Error(name_ + ": call materialize(pool, seed) before forward");
  if (x.shape().rank() != 4 || x.dim(1) != input_[0] || x.dim(2) != input_[1] || x.dim(3) != input_[2])
    throw ShapeError(name_ + ": expected input [N," + std::to_string(input_[0]) + "," +
                     std::to_string(input_[1]) + "," + std::to_string(input_[2]) + "], got " +
                     x.shape().str());
  return root_->forward(ctx, x);
}

void Model::backward(Context& ctx, const Tensor& dlogits) { root_->backward(ctx, dlogits); }

void Model::zero_grad() {
  if (grads_.defined()) ops::backend_for(grads_.device()).fill(grads_, 0.f);
}

void Model::bind_grad(int slot, const Tensor& flat) {
  const auto& p = reg_.params().at(static_cast<size_t>(slot));
  *p.grad = flat.defined() ? flat.view(0, p.shape) : Tensor();
}

void Model::release_grads() {
  for (auto& p : reg_.params()) *p.grad = Tensor();
  grads_ = Tensor();
}

std::string Model::summary() const {
  std::ostringstream os;
  int64_t real = 0;
  for (auto& p : reg_.params()) real += p.shape.numel();
  os << name_ << ": " << real << " parameters in " << reg_.params().size() << " tensors, input "
     << input_.str() << ", " << classes_ << " classes";
  return os.str();
}

}  // namespace replica::nn
