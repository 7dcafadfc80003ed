// A complete custom trainer on replica's library API, the way a C++ user writes one:
//  - builds a small CNN from replica's layers plus a layer of its own (LeakyReLU: forward and
//    backward, nothing else), so no backward code is needed for the rest of the model;
//  - runs it data-parallel on 2 CPU replicas with ReplicaGroup (pmap) and owns the loop:
//    zero_grad, micro-steps, apply, exactly as DESIGN.md's step.
// Build: part of the normal build (target replica_example_custom_trainer). Run it with no arguments.
#include <cmath>
#include <cstdio>

#include "data/dataset.h"
#include "data/loader.h"
#include "ops/nn/model.h"
#include "optim/optimizer.h"
#include "parallel/replica_group.h"
#include "train/replica_step.h"

using namespace replica;

// A user-defined layer: y = x if x > 0 else 0.1 x. Forward saves its input for backward.
class LeakyReLU : public nn::Layer {
 public:
  explicit LeakyReLU(std::string name) : Layer(std::move(name)) {}
  Tensor forward(nn::Context& ctx, const Tensor& x) override {
    Tensor y = ctx.alloc(x.shape());
    for (int64_t i = 0; i < x.numel(); ++i) {
      float v = x.data<float>()[i];
      y.data<float>()[i] = v > 0 ? v : 0.1f * v;
    }
    if (ctx.training()) ctx.saved(this) = {x};
    return y;
  }
  Tensor backward(nn::Context& ctx, const Tensor& dy) override {
    Tensor x = ctx.saved(this).at(0);
    ctx.release(this);
    Tensor dx = ctx.alloc(x.shape());
    for (int64_t i = 0; i < x.numel(); ++i)
      dx.data<float>()[i] = dy.data<float>()[i] * (x.data<float>()[i] > 0 ? 1.f : 0.1f);
    return dx;
  }
  Shape output_shape(const Shape& in) const override { return in; }
};

std::unique_ptr<nn::Model> make_model() {
  auto net = std::make_unique<nn::Sequential>("net");
  net->emplace<nn::Conv2d>("conv1", 1, 8, 3, 1, 1).set_input_grad(false);
  net->emplace<nn::BatchNorm2d>("bn1", 8);
  net->emplace<LeakyReLU>("act1");
  net->emplace<nn::Conv2d>("conv2", 8, 16, 3, 2, 1);
  net->emplace<nn::BatchNorm2d>("bn2", 16);
  net->emplace<LeakyReLU>("act2");
  net->emplace<nn::GlobalAvgPool>("pool");
  net->emplace<nn::Linear>("fc", 16, 4);
  return std::make_unique<nn::Model>("tiny-cnn", std::move(net), Shape{12, 12, 1}, 4);
}

int main() {
  const int replicas = 2, micro = 16, accumulation = 2, steps = 30;
  data::SyntheticDataset ds(Shape{12, 12, 1}, 4, 512);
  data::Sharding sharding(ds.size(), micro, accumulation, replicas, /*seed=*/1, /*shuffle=*/true);

  parallel::ReplicaGroup group(parse_devices("cpu:" + std::to_string(replicas)), {});
  std::vector<double> losses;
  group.run([&](parallel::Replica& rep) {
    auto model = make_model();
    model->materialize(rep.pool(), /*seed=*/1);
    parallel::broadcast_from_root(rep.comm(), model->params());
    optim::Sgd sgd(model->registry(), model->num_params(), rep.pool(), {.momentum = 0.9f});
    train::ReplicaStep rs(rep, *model, sgd, {.accumulation = accumulation, .micro_batch = micro});
    data::ReplicaLoader loader(ds, sharding, rep.rank(), rep.pool(), {}, /*seed=*/1);
    loader.begin_epoch(0);
    for (int step = 0; step < steps; ++step) {
      if (step % sharding.steps_per_epoch() == 0 && step) loader.begin_epoch(step / sharding.steps_per_epoch());
      rs.zero_grad();
      for (int k = 0; k < accumulation; ++k) {
        data::Batch b = loader.next();
        rs.micro_step(b.images, b.labels, /*last=*/k == accumulation - 1);
      }
      train::StepStatus st = rs.apply(/*lr=*/0.05f);
      if (rep.rank() == 0) losses.push_back(st.loss);
    }
  });
  std::printf("custom trainer: %d replicas, loss %.3f at step 1 -> %.3f at step %d\n", replicas, losses.front(),
              losses.back(), steps);
  return losses.back() < losses.front() ? 0 : 1;
}
