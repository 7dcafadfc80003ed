// `replica bench host`: what replica's own host code costs per op, apart from any device. A
// model's training pass (forward, loss, backward) runs through a backend whose ops do nothing but
// count, on CPU memory, so the time left is the framework's share of each op: layer dispatch,
// shape checks, pool allocation and release, saved tensors, gradient hooks. On a GPU the driver's
// and cuDNN's calls come on top (a launch costs a few microseconds); this is the floor under them,
// and what CUDA graphs would not have to repeat.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "apps/bench.h"
#include "core/errors.h"
#include "core/pools.h"
#include "ops/backend.h"
#include "ops/models/resnet.h"
#include "ops/nn/training_pass.h"

namespace replica::apps {
namespace {

using Clock = std::chrono::steady_clock;

// Every op a no-op that counts itself: what is timed is everything around the ops.
class CountingNullBackend final : public ops::Backend {
 public:
  int64_t ops = 0;
  std::string name() const override { return "null (counts ops, computes nothing)"; }
  void conv2d_forward(const Tensor&, const Tensor&, const Tensor&, const ops::ConvGeom&, MemoryPool&) override { ++ops; }
  void conv2d_backward_data(const Tensor&, const Tensor&, const Tensor&, const ops::ConvGeom&, MemoryPool&,
                            bool) override {
    ++ops;
  }
  void conv2d_backward_filter(const Tensor&, const Tensor&, const Tensor&, const ops::ConvGeom&, MemoryPool&) override {
    ++ops;
  }
  void batchnorm_forward_train(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                               const Tensor&, const Tensor&, float, float, const ops::AllReduceFn&, const Tensor&,
                               bool) override {
    ++ops;
  }
  void batchnorm_forward_eval(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              float, const Tensor&, bool) override {
    ++ops;
  }
  void batchnorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, const Tensor&, const ops::AllReduceFn&, const Tensor&) override {
    ++ops;
  }
  void batchnorm_backward_frozen(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                 const Tensor&, const Tensor&, const Tensor&, const Tensor&) override {
    ++ops;
  }
  void relu_forward(const Tensor&, const Tensor&) override { ++ops; }
  void relu_backward(const Tensor&, const Tensor&, const Tensor&) override { ++ops; }
  void add(const Tensor&, const Tensor&, const Tensor&) override { ++ops; }
  void add_relu(const Tensor&, const Tensor&, const Tensor&) override { ++ops; }
  void axpy(float, const Tensor&, const Tensor&) override { ++ops; }
  void fill(const Tensor&, float) override { ++ops; }
  void scale(const Tensor&, float) override { ++ops; }
  void maxpool_forward(const Tensor&, const Tensor&, const Tensor&, const ops::PoolGeom&) override { ++ops; }
  void maxpool_backward(const Tensor&, const Tensor&, const Tensor&, const ops::PoolGeom&) override { ++ops; }
  void global_avgpool_forward(const Tensor&, const Tensor&) override { ++ops; }
  void global_avgpool_backward(const Tensor&, const Tensor&) override { ++ops; }
  void linear_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&) override { ++ops; }
  void linear_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                       const Tensor&) override {
    ++ops;
  }
  LossResult softmax_xent_forward(const Tensor&, const Tensor&, const Tensor&) override {
    ++ops;
    return {};
  }
  void softmax_xent_accumulate(const Tensor&, const Tensor&, const Tensor&, const Tensor&) override { ++ops; }
  void softmax_xent_backward(const Tensor&, const Tensor&, float, const Tensor&) override { ++ops; }
  void cast(const Tensor&, const Tensor&) override { ++ops; }
  double sum_squares(const Tensor&) override {
    ++ops;
    return 0;
  }
  std::vector<double> segment_sum_squares(const Tensor&, const std::vector<std::pair<int64_t, int64_t>>& s) override {
    ++ops;
    return std::vector<double>(s.size());
  }
  bool unscale_check_finite(const Tensor&, float) override {
    ++ops;
    return true;
  }
  void sum_squares_into(const Tensor&, const Tensor&) override { ++ops; }
  void unscale_check_finite_into(const Tensor&, float, const Tensor&) override { ++ops; }
  void segment_sum_squares_into(const Tensor&, const std::vector<std::pair<int64_t, int64_t>>&, const Tensor&) override {
    ++ops;
  }
  void sum_in_order_into(const Tensor&, const Tensor&) override { ++ops; }
  void read_to_host(const Tensor&, void*, const std::function<void()>&) override { ++ops; }
  void rsqrt_eps(const Tensor&, const Tensor&, float) override { ++ops; }
  void sgd_update(const Tensor&, const Tensor&, const Tensor&, const SgdUpdate&) override { ++ops; }
  void adamw_update(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const AdamWUpdate&) override { ++ops; }
  void lars_trust_ratios(const Tensor&, const Tensor&, const std::vector<std::pair<int64_t, int64_t>>&, float, float,
                         float, const Tensor&) override {
    ++ops;
  }
  void lars_update(const Tensor&, const Tensor&, const Tensor&, float, const Tensor&, float, float) override { ++ops; }
};

}  // namespace

int bench_host(const HostBenchOptions& o) {
  models::ResNetConfig cfg;
  cfg.arch = o.arch;
  const bool imagenet = o.arch == "resnet18" || o.arch == "resnet34" || o.arch == "resnet50";
  cfg.in_channels = imagenet ? 3 : 1;
  cfg.height = cfg.width = imagenet ? 224 : 28;
  cfg.num_classes = imagenet ? 1000 : 10;
  if (o.passes < 1 || o.batch < 1) throw ConfigError("bench host: --passes and --batch must be at least 1");
  PoolOptions po;
  po.mode = AllocatorMode::growth;
  auto pool = make_pool({DeviceKind::cpu, 0}, po);  // the pages of what is allocated are never touched
  auto model = models::make_resnet(cfg);            // after the pool: its tensors go back to it first
  model->materialize(*pool, 1);
  CountingNullBackend be;
  Tensor images = Tensor::empty(*pool, {o.batch, cfg.height, cfg.width, cfg.in_channels}, DType::f32, MemTag::activations);
  Tensor labels = Tensor::empty(*pool, {o.batch}, DType::i32, MemTag::activations);
  double fwd = 0, bwd = 0;
  int64_t fwd_ops = 0, bwd_ops = 0;
  std::printf("# replica bench host: %s, batch %ld, %d passes through a backend that computes nothing (%s); "
              "the host time replica itself spends around each op\n",
              o.arch.c_str(), static_cast<long>(o.batch), o.passes, be.name().c_str());
  for (int pass = -3; pass < o.passes; ++pass) {  // three passes unmeasured (the pool grows)
    nn::Context ctx(*pool, be, true);
    int64_t ready = 0;
    ctx.on_grads_ready = [&](int, int count) { ready += count; };  // the gradient hook's call, as a step has
    Tensor dlogits;
    const int64_t ops0 = be.ops;
    const auto t0 = Clock::now();
    nn::forward_and_loss(ctx, *model, images, labels, 1.f, dlogits);
    const auto t1 = Clock::now();
    const int64_t ops1 = be.ops;
    model->backward(ctx, dlogits);
    const auto t2 = Clock::now();
    if (pass < 0) continue;
    fwd += std::chrono::duration<double>(t1 - t0).count();
    bwd += std::chrono::duration<double>(t2 - t1).count();
    fwd_ops += ops1 - ops0;
    bwd_ops += be.ops - ops1;
  }
  const double n = o.passes;
  std::printf("# %-10s %10s %12s %12s\n", "half", "ops", "us", "us per op");
  std::printf("%-12s %10.0f %12.1f %12.2f\n", "forward", fwd_ops / n, 1e6 * fwd / n, 1e6 * fwd / fwd_ops);
  std::printf("%-12s %10.0f %12.1f %12.2f\n", "backward", bwd_ops / n, 1e6 * bwd / n, 1e6 * bwd / bwd_ops);
  std::printf("%-12s %10.0f %12.1f %12.2f\n", "pass", (fwd_ops + bwd_ops) / n, 1e6 * (fwd + bwd) / n,
              1e6 * (fwd + bwd) / (fwd_ops + bwd_ops));
  return 0;
}

}  // namespace replica::apps
