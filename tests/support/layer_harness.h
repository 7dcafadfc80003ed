// Test support: owns a layer's flat parameter buffers outside a Model and checks its gradients
// against central finite differences of the scalar loss sum(y * r) for a fixed random r.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/pools.h"
#include "ops/nn/layer.h"

namespace replica::testing {

inline std::unique_ptr<MemoryPool> test_pool() {
  PoolOptions o;
  o.mode = AllocatorMode::growth;
  o.bytes = size_t(1) << 30;
  return make_pool({DeviceKind::cpu, 0}, o);
}

inline void fill_random(const Tensor& t, std::mt19937& rng, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> d(lo, hi);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = d(rng);
}

class LayerHarness {
 public:
  LayerHarness(nn::Layer& layer, MemoryPool& pool, uint32_t seed = 1) : layer_(layer), pool_(pool) {
    layer_.register_params(reg_);
    int64_t n = 0, nb = 0;
    for (auto& p : reg_.params()) { p.offset = n; n += p.shape.numel(); }
    for (auto& b : reg_.buffers()) { b.offset = nb; nb += b.shape.numel(); }
    params_ = Tensor::zeros(pool, {std::max<int64_t>(n, 1)}, DType::f32, MemTag::params);
    grads_ = Tensor::zeros(pool, {std::max<int64_t>(n, 1)}, DType::f32, MemTag::grads);
    bufs_ = Tensor::zeros(pool, {std::max<int64_t>(nb, 1)}, DType::f32, MemTag::params);
    std::mt19937 rng(seed);
    for (auto& p : reg_.params()) {
      *p.value = params_.view(p.offset, p.shape);
      *p.grad = grads_.view(p.offset, p.shape);
      // gamma near 1 keeps batch norm well conditioned
      if (p.kind == nn::ParamKind::bn_gamma) fill_random(*p.value, rng, 0.5f, 1.5f);
      else fill_random(*p.value, rng, -0.5f, 0.5f);
    }
    for (auto& b : reg_.buffers()) {
      *b.value = bufs_.view(b.offset, b.shape);
      std::fill_n(b.value->data<float>(), b.shape.numel(), b.init);
    }
  }

  // Frozen batch norm (model.freeze_bn): training mode, normalised by the running statistics,
  // which are set to values away from their (0, 1) start so that every use of them shows.
  void freeze_bn(uint32_t seed = 11) {
    bn_frozen_ = true;
    std::mt19937 rng(seed);
    for (auto& b : reg_.buffers())
      if (b.init == 1.f) fill_random(*b.value, rng, 0.3f, 2.5f);  // running_var
      else fill_random(*b.value, rng, -0.7f, 0.7f);              // running_mean
  }

  // loss = sum(forward(x) * r) in double
  double loss(const Tensor& x, const Tensor& r) {
    nn::Context ctx(pool_, ops::backend_for(x.device()), true);
    ctx.bn_frozen = bn_frozen_;
    Tensor y = layer_.forward(ctx, x);
    double s = 0;
    for (int64_t i = 0; i < y.numel(); ++i) s += static_cast<double>(y.data<float>()[i]) * r.data<float>()[i];
    return s;
  }

  // Checks d loss / d x and d loss / d params at `samples` random coordinates each.
  void check(const Tensor& x, double tol, int samples = 40, float eps = 1e-2f) {
    nn::Context ctx(pool_, ops::backend_for(x.device()), true);
    ctx.bn_frozen = bn_frozen_;
    Tensor y = layer_.forward(ctx, x);
    Tensor r = Tensor::empty(pool_, y.shape(), DType::f32, MemTag::other);
    std::mt19937 rng(7);
    fill_random(r, rng);
    std::memset(grads_.raw(), 0, grads_.nbytes());
    Tensor dy = Tensor::empty(pool_, y.shape(), DType::f32, MemTag::other);
    copy_tensor(r, dy);
    int ready = 0;
    ctx.on_grads_ready = [&](int, int count) { ready += count; };
    Tensor dx = layer_.backward(ctx, dy);
    EXPECT_EQ(ctx.saved_count(), 0u) << layer_.name() << ": backward must release what forward saved";
    EXPECT_EQ(ready, static_cast<int>(reg_.params().size())) << "every parameter slot reported ready";
    auto numeric = [&](float* v) {
      float old = *v;
      *v = old + eps;
      double lp = loss(x, r);
      *v = old - eps;
      double lm = loss(x, r);
      *v = old;
      return (lp - lm) / (2.0 * eps);
    };
    auto compare = [&](const char* what, double analytic, double num) {
      double err = std::abs(analytic - num) / std::max(1.0, std::abs(num));
      EXPECT_LT(err, tol) << layer_.name() << " " << what << ": analytic " << analytic << " vs numeric " << num;
    };
    if (dx.defined()) {
      for (int s = 0; s < samples; ++s) {
        int64_t i = rng() % x.numel();
        compare("dx", dx.data<float>()[i], numeric(x.data<float>() + i));
      }
    }
    for (auto& p : reg_.params()) {
      for (int s = 0; s < std::min<int>(samples, p.shape.numel()); ++s) {
        int64_t i = rng() % p.shape.numel();
        compare(p.name.c_str(), p.grad->data<float>()[i], numeric(p.value->data<float>() + i));
      }
    }
  }

  nn::ParamRegistry& reg() { return reg_; }
  Tensor& params() { return params_; }
  Tensor& grads() { return grads_; }
  Tensor& buffers() { return bufs_; }  // running statistics
  bool bn_frozen() const { return bn_frozen_; }

 private:
  nn::Layer& layer_;
  MemoryPool& pool_;
  nn::ParamRegistry reg_;
  Tensor params_, grads_, bufs_;
  bool bn_frozen_ = false;
};

}  // namespace replica::testing
