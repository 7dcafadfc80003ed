// `replica bench host`: where the host's time per op goes in a model's training pass (forward,
// loss, backward), by kind of op. Every backend call is timed on the host clock (TimedBackend):
//  - --kind null: a backend that computes nothing, on CPU memory: what is left is replica's own
//    share of each op (layer dispatch, shape checks, pool allocation, saved tensors, hooks);
//  - --kind cuda: the CUDA backend on GPU 0, where a call returns once its work is enqueued: what
//    issuing each op costs (driver launches, cuDNN's and cuBLAS's host work, the pool's streams):
//    the cost that bounds small batches and that CUDA graphs would not repeat;
//  - --kind cpu: the CPU backend, where a call is its computation.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "apps/bench.h"
#include "core/cuda/runtime.h"
#include "core/errors.h"
#include "core/pools.h"
#include "core/stream.h"
#include "ops/backend.h"
#include "ops/models/resnet.h"
#include "ops/nn/training_pass.h"
#include "optim/optimizer.h"

namespace replica::apps {
namespace {

using Clock = std::chrono::steady_clock;

// Every op a no-op: what is timed is everything around the ops.
class NullBackend final : public ops::Backend {
 public:
  std::string name() const override { return "null (computes nothing)"; }
  void conv2d_forward(const Tensor&, const Tensor&, const Tensor&, const ops::ConvGeom&, MemoryPool&) override {}
  void conv2d_backward_data(const Tensor&, const Tensor&, const Tensor&, const ops::ConvGeom&, MemoryPool&,
                            bool) override {}
  void conv2d_backward_filter(const Tensor&, const Tensor&, const Tensor&, const ops::ConvGeom&, MemoryPool&) override {}
  void batchnorm_forward_train(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                               const Tensor&, const Tensor&, float, float, const ops::AllReduceFn&, const Tensor&,
                               bool) override {}
  void batchnorm_forward_eval(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              float, const Tensor&, bool) override {}
  void batchnorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, const Tensor&, const ops::AllReduceFn&, const Tensor&) override {}
  void batchnorm_backward_frozen(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                 const Tensor&, const Tensor&, const Tensor&, const Tensor&) override {}
  void relu_forward(const Tensor&, const Tensor&) override {}
  void relu_backward(const Tensor&, const Tensor&, const Tensor&) override {}
  void add(const Tensor&, const Tensor&, const Tensor&) override {}
  void add_relu(const Tensor&, const Tensor&, const Tensor&) override {}
  void axpy(float, const Tensor&, const Tensor&) override {}
  void fill(const Tensor&, float) override {}
  void set_values(const Tensor&, const float*, int64_t) override {}
  void scale(const Tensor&, float) override {}
  void maxpool_forward(const Tensor&, const Tensor&, const Tensor&, const ops::PoolGeom&) override {}
  void maxpool_backward(const Tensor&, const Tensor&, const Tensor&, const ops::PoolGeom&) override {}
  void global_avgpool_forward(const Tensor&, const Tensor&) override {}
  void global_avgpool_backward(const Tensor&, const Tensor&) override {}
  void linear_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&) override {}
  void linear_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                       const Tensor&) override {}
  LossResult softmax_xent_forward(const Tensor&, const Tensor&, const Tensor&) override {
    return {};
  }
  void softmax_xent_accumulate(const Tensor&, const Tensor&, const Tensor&, const Tensor&, float) override {}
  void softmax_xent_backward(const Tensor&, const Tensor&, const ops::StepScalar&, const Tensor&, float) override {}
  void cast(const Tensor&, const Tensor&) override {}
  double sum_squares(const Tensor&) override {
    return 0;
  }
  std::vector<double> segment_sum_squares(const Tensor&, const std::vector<std::pair<int64_t, int64_t>>& s) override {
    return std::vector<double>(s.size());
  }
  bool unscale_check_finite(const Tensor&, float) override {
    return true;
  }
  void sum_squares_into(const Tensor&, const Tensor&) override {}
  void unscale_check_finite_into(const Tensor&, const ops::StepScalar&, const Tensor&) override {}
  void segment_sum_squares_into(const Tensor&, const std::vector<std::pair<int64_t, int64_t>>&, const Tensor&) override {}
  void sum_in_order_into(const Tensor&, const Tensor&) override {}
  void read_to_host(const Tensor&, void*, const std::function<void()>&) override {}
  void rsqrt_eps(const Tensor&, const Tensor&, float) override {}
  void sgd_update(const Tensor&, const Tensor&, const Tensor&, const SgdUpdate&, const ops::ChunkClasses&,
                  const Tensor&) override {}
  void adamw_update(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const AdamWUpdate&, const ops::ChunkClasses&,
                    const Tensor&) override {}
  void lars_trust_ratios(const Tensor&, const Tensor&, const std::vector<std::pair<int64_t, int64_t>>&, float, float,
                         float, const Tensor&) override {}
  void lars_update(const Tensor&, const Tensor&, const Tensor&, const ops::StepScalar&, const Tensor&, float, float,
                   const ops::ChunkClasses&, const Tensor&, const Tensor&) override {}
  void step_gate(const Tensor&, const StepGateAt&, double) override {}
  void scale_by(const Tensor&, const Tensor&) override {}
};


// Forwards every op to `inner` and times each call on the host clock, per kind of op: what the host
// spends issuing it (on a GPU the call returns once the work is enqueued; the device runs behind).
class TimedBackend final : public ops::Backend {
 public:
  struct Stat {
    int64_t calls = 0;
    double seconds = 0;
  };
  explicit TimedBackend(ops::Backend& inner) : in_(inner) {}
  std::map<std::string, Stat> stats;
  int64_t calls = 0;
  void reset() { stats.clear(), calls = 0; }

  std::string name() const override { return in_.name(); }
  void set_deterministic(bool on) override { in_.set_deterministic(on); }
  bool deterministic() const override { return in_.deterministic(); }
  void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& y, const ops::ConvGeom& g, MemoryPool& ws) override {
    Timer t(*this, "conv forward");
    in_.conv2d_forward(x, w, y, g, ws);
  }
  void conv2d_backward_data(const Tensor& dy, const Tensor& w, const Tensor& dx, const ops::ConvGeom& g, MemoryPool& ws,
                            bool acc) override {
    Timer t(*this, acc ? "conv backward data (+=)" : "conv backward data");
    in_.conv2d_backward_data(dy, w, dx, g, ws, acc);
  }
  void conv2d_backward_filter(const Tensor& x, const Tensor& dy, const Tensor& dw, const ops::ConvGeom& g,
                              MemoryPool& ws) override {
    Timer t(*this, "conv backward filter");
    in_.conv2d_backward_filter(x, dy, dw, g, ws);
  }
  void batchnorm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y,
                               const Tensor& sm, const Tensor& si, const Tensor& rm, const Tensor& rv, float momentum,
                               float eps, const ops::AllReduceFn& ar, const Tensor& res, bool relu) override {
    Timer t(*this, res.defined() ? "batch norm + add + relu forward" : relu ? "batch norm + relu forward" : "batch norm forward");
    in_.batchnorm_forward_train(x, gamma, beta, y, sm, si, rm, rv, momentum, eps, ar, res, relu);
  }
  void batchnorm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y, const Tensor& rm,
                              const Tensor& rv, float eps, const Tensor& res, bool relu) override {
    Timer t(*this, "batch norm forward (eval)");
    in_.batchnorm_forward_eval(x, gamma, beta, y, rm, rv, eps, res, relu);
  }
  void batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& sm, const Tensor& si,
                          const Tensor& dx, const Tensor& dg, const Tensor& db, const ops::AllReduceFn& ar,
                          const Tensor& ry) override {
    Timer t(*this, ry.defined() ? "batch norm + relu backward" : "batch norm backward");
    in_.batchnorm_backward(dy, x, gamma, sm, si, dx, dg, db, ar, ry);
  }
  void batchnorm_backward_frozen(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& m,
                                 const Tensor& inv, const Tensor& dx, const Tensor& dg, const Tensor& db,
                                 const Tensor& ry) override {
    Timer t(*this, "batch norm backward (frozen)");
    in_.batchnorm_backward_frozen(dy, x, gamma, m, inv, dx, dg, db, ry);
  }
  void relu_forward(const Tensor& x, const Tensor& y) override {
    Timer t(*this, "relu");
    in_.relu_forward(x, y);
  }
  void relu_backward(const Tensor& y, const Tensor& dy, const Tensor& dx) override {
    Timer t(*this, "relu backward");
    in_.relu_backward(y, dy, dx);
  }
  void add(const Tensor& a, const Tensor& b, const Tensor& y) override {
    Timer t(*this, "add");
    in_.add(a, b, y);
  }
  void add_relu(const Tensor& a, const Tensor& b, const Tensor& y) override {
    Timer t(*this, "add + relu");
    in_.add_relu(a, b, y);
  }
  void axpy(float alpha, const Tensor& x, const Tensor& y) override {
    Timer t(*this, "axpy");
    in_.axpy(alpha, x, y);
  }
  void fill(const Tensor& y, float v) override {
    Timer t(*this, "fill");
    in_.fill(y, v);
  }
  void set_values(const Tensor& y, const float* v, int64_t n) override {
    Timer t(*this, "set step values");
    in_.set_values(y, v, n);
  }
  void scale(const Tensor& y, float a) override {
    Timer t(*this, "scale");
    in_.scale(y, a);
  }
  void maxpool_forward(const Tensor& x, const Tensor& y, const Tensor& arg, const ops::PoolGeom& g) override {
    Timer t(*this, "max pool");
    in_.maxpool_forward(x, y, arg, g);
  }
  void maxpool_backward(const Tensor& dy, const Tensor& arg, const Tensor& dx, const ops::PoolGeom& g) override {
    Timer t(*this, "max pool backward");
    in_.maxpool_backward(dy, arg, dx, g);
  }
  void global_avgpool_forward(const Tensor& x, const Tensor& y) override {
    Timer t(*this, "average pool");
    in_.global_avgpool_forward(x, y);
  }
  void global_avgpool_backward(const Tensor& dy, const Tensor& dx) override {
    Timer t(*this, "average pool backward");
    in_.global_avgpool_backward(dy, dx);
  }
  void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y) override {
    Timer t(*this, "linear");
    in_.linear_forward(x, w, b, y);
  }
  void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                       const Tensor& db) override {
    Timer t(*this, "linear backward");
    in_.linear_backward(x, w, dy, dx, dw, db);
  }
  LossResult softmax_xent_forward(const Tensor& z, const Tensor& l, const Tensor& p) override {
    Timer t(*this, "loss (read)");
    return in_.softmax_xent_forward(z, l, p);
  }
  void softmax_xent_accumulate(const Tensor& z, const Tensor& l, const Tensor& p, const Tensor& sums,
                               float smoothing) override {
    Timer t(*this, "loss");
    in_.softmax_xent_accumulate(z, l, p, sums, smoothing);
  }
  void softmax_xent_backward(const Tensor& p, const Tensor& l, const ops::StepScalar& scale, const Tensor& dz,
                             float smoothing) override {
    Timer t(*this, "loss backward");
    in_.softmax_xent_backward(p, l, scale, dz, smoothing);
  }
  void cast(const Tensor& src, const Tensor& dst) override {
    Timer t(*this, "cast");
    in_.cast(src, dst);
  }
  double sum_squares(const Tensor& x) override {
    Timer t(*this, "sum of squares (read)");
    return in_.sum_squares(x);
  }
  std::vector<double> segment_sum_squares(const Tensor& x, const std::vector<std::pair<int64_t, int64_t>>& s) override {
    Timer t(*this, "segment sums of squares (read)");
    return in_.segment_sum_squares(x, s);
  }
  bool unscale_check_finite(const Tensor& g, float inv) override {
    Timer t(*this, "unscale + finite check (read)");
    return in_.unscale_check_finite(g, inv);
  }
  void sum_squares_into(const Tensor& x, const Tensor& out) override {
    Timer t(*this, "sum of squares");
    in_.sum_squares_into(x, out);
  }
  void unscale_check_finite_into(const Tensor& g, const ops::StepScalar& inv, const Tensor& flag) override {
    Timer t(*this, "unscale + finite check");
    in_.unscale_check_finite_into(g, inv, flag);
  }
  void segment_sum_squares_into(const Tensor& x, const std::vector<std::pair<int64_t, int64_t>>& s,
                                const Tensor& out) override {
    Timer t(*this, "segment sums of squares");
    in_.segment_sum_squares_into(x, s, out);
  }
  void sum_in_order_into(const Tensor& x, const Tensor& out) override {
    Timer t(*this, "sum in order");
    in_.sum_in_order_into(x, out);
  }
  void read_to_host(const Tensor& src, void* dst, const std::function<void()>& poll) override {
    Timer t(*this, "read to host (waits)");
    in_.read_to_host(src, dst, poll);
  }
  void rsqrt_eps(const Tensor& x, const Tensor& y, float eps) override {
    Timer t(*this, "rsqrt");
    in_.rsqrt_eps(x, y, eps);
  }
  void sgd_update(const Tensor& p, const Tensor& g, const Tensor& b, const SgdUpdate& u, const ops::ChunkClasses& k,
                  const Tensor& c) override {
    Timer t(*this, "sgd update");
    in_.sgd_update(p, g, b, u, k, c);
  }
  void adamw_update(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const AdamWUpdate& u,
                    const ops::ChunkClasses& k, const Tensor& c) override {
    Timer t(*this, "adamw update");
    in_.adamw_update(p, g, m, v, u, k, c);
  }
  void lars_trust_ratios(const Tensor& p, const Tensor& g, const std::vector<std::pair<int64_t, int64_t>>& s, float trust,
                         float wd, float eps, const Tensor& r) override {
    Timer t(*this, "lars ratios");
    in_.lars_trust_ratios(p, g, s, trust, wd, eps, r);
  }
  void lars_update(const Tensor& p, const Tensor& g, const Tensor& b, const ops::StepScalar& lr, const Tensor& r, float m,
                   float wd, const ops::ChunkClasses& k, const Tensor& c, const Tensor& gate) override {
    Timer t(*this, "lars update");
    in_.lars_update(p, g, b, lr, r, m, wd, k, c, gate);
  }
  void step_gate(const Tensor& s, const StepGateAt& at, double max_norm) override {
    Timer t(*this, "step gate");
    in_.step_gate(s, at, max_norm);
  }
  void scale_by(const Tensor& y, const Tensor& f) override {
    Timer t(*this, "scale by");
    in_.scale_by(y, f);
  }

 private:
  struct Timer {
    Timer(TimedBackend& b, const char* op) : b(b), op(op), t0(Clock::now()) {}
    ~Timer() {
      Stat& s = b.stats[op];
      s.calls++;
      s.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
      b.calls++;
    }
    TimedBackend& b;
    const char* op;
    Clock::time_point t0;
  };
  ops::Backend& in_;
};

}  // namespace

// The optimizer's share of a step: its backend calls and their host time per step, for SGD with
// batch norm and biases out of weight decay (configs/resnet50_synthetic_gpu.yaml) and LARS (the
// MLPerf recipe), beside the parameter groups one call each would have taken.
void bench_optimizer_steps(nn::Model& model, MemoryPool& pool, TimedBackend& be, int steps, Stream* gpu) {
  std::printf("# %-40s %8s %8s %12s\n", "optimizer step (the whole flat buffer)", "groups", "calls", "us");
  for (const std::string name : {"sgd", "lars"}) {
    std::unique_ptr<optim::Optimizer> opt;
    int64_t groups = 0;
    if (name == "lars") {
      opt = std::make_unique<optim::Lars>(model.registry(), model.num_params(), pool, optim::LarsOptions{});
      groups = static_cast<int64_t>(model.registry().params().size());
    } else {
      optim::SgdOptions so;
      so.nesterov = false;
      so.no_decay_bn_bias = true;
      opt = std::make_unique<optim::Sgd>(model.registry(), model.num_params(), pool, so);
      groups = static_cast<int64_t>(optim::make_groups(model.registry(), true).size());
    }
    opt->use_backend(&be);
    double seconds = 0;
    int64_t calls = 0;
    for (int step = -3; step < steps; ++step) {
      const int64_t c0 = be.calls;
      const auto t0 = Clock::now();
      opt->step(model.params(), model.grads(), 0.1f, model.compute_copy());
      const auto t1 = Clock::now();
      if (gpu) gpu->synchronize();  // not timed: what issuing the update costs the host
      if (step < 0) continue;
      seconds += std::chrono::duration<double>(t1 - t0).count();
      calls += be.calls - c0;
    }
    std::printf("%-42s %8ld %8.0f %12.1f\n", name == "lars" ? "lars" : "sgd, no_decay_bn_bias",
                static_cast<long>(groups), static_cast<double>(calls) / steps, 1e6 * seconds / steps);
  }
}

int bench_host(const HostBenchOptions& o) {
  if (o.passes < 1 || o.batch < 1) throw ConfigError("bench host: --passes and --batch must be at least 1");
  const bool gpu = o.kind == "cuda", null = o.kind == "null";
  if (gpu && cuda_devices().empty()) throw ConfigError("bench host --kind cuda: no CUDA device is visible");
  const Device dev = gpu ? Device{DeviceKind::cuda, 0} : Device{DeviceKind::cpu, 0};
  if (gpu) cuda::set_device(0);
  models::ResNetConfig cfg;
  cfg.arch = o.arch;
  const bool imagenet = models::imagenet_style(o.arch);
  cfg.in_channels = imagenet ? 3 : 1;
  cfg.height = cfg.width = imagenet ? 224 : 28;
  cfg.num_classes = imagenet ? 1000 : 10;
  PoolOptions po;
  po.mode = AllocatorMode::growth;
  auto pool = make_pool(dev, po);  // null: the pages of what is allocated are never touched
  auto stream = make_stream(dev);  // a replica's compute stream, as in training
  set_current_stream(stream.get());
  auto model = models::make_resnet(cfg);  // after the pool: its tensors go back to it first
  const DType compute = parse_dtype(o.dtype);
  model->materialize(*pool, 1, compute);
  NullBackend nothing;
  TimedBackend be(null ? static_cast<ops::Backend&>(nothing) : ops::backend_for(dev));
  Tensor images = Tensor::empty(*pool, {o.batch, cfg.height, cfg.width, cfg.in_channels}, DType::f32, MemTag::activations);
  Tensor labels = Tensor::empty(*pool, {o.batch}, DType::i32, MemTag::activations);
  if (!null) {
    ops::backend_for(dev).fill(images, 0.5f);
    tensor_from_bytes(labels, std::vector<int32_t>(static_cast<size_t>(o.batch), 1).data(), labels.nbytes());
  }
  std::printf("# replica bench host: %s %s, batch %ld, %d passes (forward, loss, backward) through %s: the host time of "
              "each op's call (a GPU runs behind: this is what issuing the work costs)\n",
              o.arch.c_str(), dtype_name(compute), static_cast<long>(o.batch), o.passes, be.name().c_str());
  double fwd = 0, bwd = 0;
  int64_t fwd_ops = 0, bwd_ops = 0;
  for (int pass = -3; pass < o.passes; ++pass) {  // three unmeasured: the pool grows, cuDNN chooses
    if (pass == 0) be.reset();
    nn::Context ctx(*pool, be, true);
    ctx.act_dtype = compute;
    int64_t ready = 0;
    ctx.on_grads_ready = [&](int, int count) { ready += count; };  // the gradient hook's call, as a step has
    Tensor dlogits;
    const int64_t ops0 = be.calls;
    const auto t0 = Clock::now();
    nn::forward_and_loss(ctx, *model, images, labels, 1.f, dlogits);
    const auto t1 = Clock::now();
    const int64_t ops1 = be.calls;
    model->backward(ctx, dlogits);
    const auto t2 = Clock::now();
    if (pass < 0 || gpu) stream->synchronize();  // a GPU's queue drains between passes (not timed)
    if (pass < 0) continue;
    fwd += std::chrono::duration<double>(t1 - t0).count();
    bwd += std::chrono::duration<double>(t2 - t1).count();
    fwd_ops += ops1 - ops0;
    bwd_ops += be.calls - ops1;
  }
  const double n = o.passes;
  std::printf("# %-34s %8s %12s %12s\n", "op", "calls", "us", "us per call");
  std::vector<std::pair<std::string, TimedBackend::Stat>> rows(be.stats.begin(), be.stats.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
  double in_ops = 0;
  for (const auto& [op, st] : rows) {
    in_ops += st.seconds;
    std::printf("%-36s %8.0f %12.1f %12.2f\n", op.c_str(), st.calls / n, 1e6 * st.seconds / n, 1e6 * st.seconds / st.calls);
  }
  std::printf("# %-10s %10s %12s %12s\n", "half", "ops", "us", "us per op");
  std::printf("%-12s %10.0f %12.1f %12.2f\n", "forward", fwd_ops / n, 1e6 * fwd / n, 1e6 * fwd / fwd_ops);
  std::printf("%-12s %10.0f %12.1f %12.2f\n", "backward", bwd_ops / n, 1e6 * bwd / n, 1e6 * bwd / bwd_ops);
  std::printf("%-12s %10.0f %12.1f %12.2f\n", "pass", (fwd_ops + bwd_ops) / n, 1e6 * (fwd + bwd) / n,
              1e6 * (fwd + bwd) / (fwd_ops + bwd_ops));
  std::printf("# outside the ops' calls (layers, allocation, saved tensors, hooks): %.1f us a pass, %.2f us per op\n",
              1e6 * (fwd + bwd - in_ops) / n, 1e6 * (fwd + bwd - in_ops) / (fwd_ops + bwd_ops));
  bench_optimizer_steps(*model, *pool, be, o.passes, gpu ? stream.get() : nullptr);
  set_current_stream(nullptr);
  return 0;
}

}  // namespace replica::apps
