// Mixed precision and accumulation: an overflow planted on one replica makes every replica skip
// the step and change nothing; 16-bit activations halve activation memory; fp16/bf16 training
// tracks fp32; accumulation of k micro-batches equals one batch of k*b (frozen BN), on 1 and 2
// replicas; a NaN loss in fp32 stops the run naming the step.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <filesystem>
#include <map>
#include <random>

#include "core/errors.h"
#include "support/compare.h"
#include "core/pools.h"
#include "ops/models/resnet.h"
#include "parallel/replica_group.h"
#include "support/tiny_model.h"
#include "train/replica_step.h"
#include "train/trainer.h"

using namespace replica;

namespace {

using replica::testing::random_batch;
using replica::testing::tiny_resnet;

std::vector<float> copy_of(const Tensor& t) {
  return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
}

}  // namespace

TEST(MixedPrecision, OverflowOnOneReplicaSkipsEverywhereAndChangesNothing) {
  parallel::ReplicaGroup group(parse_devices("cpu:2"), {});
  std::vector<train::StepStatus> skipped(2);
  std::vector<float> scales(2);
  group.run([&](parallel::Replica& rep) {
    auto model = tiny_resnet();
    model->materialize(rep.pool(), 1, DType::f16);
    optim::Sgd sgd(model->registry(), model->num_params(), rep.pool(), {.momentum = 0.9f});
    optim::DynamicLossScaler scaler({.init_scale = 1024.f});
    train::ReplicaStep rs(rep, *model, sgd,
                          {.accumulation = 1, .micro_batch = 8, .activations = DType::f16, .scaler = &scaler});
    Tensor x, y;
    auto step = [&](bool plant) {
      random_batch(rep.pool(), 8, 10 + rep.rank(), x, y);
      // Only rank 1 overflows: one huge pixel makes its first activations inf in fp16, so its
      // local gradients are inf/NaN and rank 0's are not. The check runs on the all-reduced
      // gradients, so both must see it.
      if (plant && rep.rank() == 1) x.data<float>()[5] = 1e6f;
      rs.zero_grad();
      rs.micro_step(x, y, true);
      return rs.apply(0.1f);
    };
    EXPECT_TRUE(step(false).applied);
    auto params = copy_of(model->params());
    auto moment = copy_of(*sgd.state()[0]);
    auto compute = std::vector<char>(static_cast<char*>(model->registry().params()[0].value->raw()),
                                     static_cast<char*>(model->registry().params()[0].value->raw()) + 64);
    const int64_t steps_before = sgd.steps();
    skipped[rep.rank()] = step(true);
    scales[rep.rank()] = scaler.scale();
    EXPECT_EQ(copy_of(model->params()), params) << "a skipped step leaves the master weights";
    EXPECT_EQ(copy_of(*sgd.state()[0]), moment) << "and the momentum";
    EXPECT_EQ(0, std::memcmp(model->registry().params()[0].value->raw(), compute.data(), 64)) << "and the fp16 copy";
    EXPECT_EQ(sgd.steps(), steps_before) << "and the step count the schedule reads";
    EXPECT_EQ(scaler.skipped(), 1);
    train::StepStatus next = step(false);
    EXPECT_TRUE(next.applied);
    EXPECT_EQ(next.step, steps_before + 1);
    EXPECT_EQ(next.scale, 512.f);
  });
  EXPECT_FALSE(skipped[0].applied) << "rank 0's own gradients were finite, yet it skipped with rank 1";
  EXPECT_FALSE(skipped[1].applied);
  EXPECT_EQ(scales[0], 512.f);
  EXPECT_EQ(scales[1], 512.f);
}

// One replica queues its update before the host reads the step's scalars, gated by the device's
// verdict (Backend::step_gate): an overflowing first step changes nothing, not even the step count
// that SGD's first momentum and AdamW's bias correction read, and the next step is the bits of a
// fresh optimizer's first step on the same parameters and gradients.
TEST(MixedPrecision, OneReplicaSkipsOnTheDeviceAndCountsOnlyAppliedSteps) {
  parallel::ReplicaGroup group(parse_devices("cpu:1"), {});
  for (const std::string name : {"sgd", "adamw"}) {
    group.run([&](parallel::Replica& rep) {
      auto model = tiny_resnet();
      model->materialize(rep.pool(), 1, DType::f16);
      auto make = [&]() -> std::unique_ptr<optim::Optimizer> {
        if (name == "adamw") return std::make_unique<optim::AdamW>(model->registry(), model->num_params(), rep.pool(),
                                                                   optim::AdamWOptions{});
        return std::make_unique<optim::Sgd>(model->registry(), model->num_params(), rep.pool(),
                                            optim::SgdOptions{.momentum = 0.9f});
      };
      auto opt = make();
      optim::DynamicLossScaler scaler({.init_scale = 1024.f});
      train::ReplicaStep rs(rep, *model, *opt,
                            {.accumulation = 1, .micro_batch = 8, .activations = DType::f16, .scaler = &scaler});
      Tensor x, y;
      auto step = [&](bool plant) {
        random_batch(rep.pool(), 8, 21, x, y);
        if (plant) x.data<float>()[5] = 1e6f;  // inf in the first fp16 activations
        rs.zero_grad();
        rs.micro_step(x, y, true);
        return rs.apply(0.1f);
      };
      const auto p0 = copy_of(model->params());
      const std::vector<char> c0(static_cast<char*>(model->compute_copy().raw()),
                                 static_cast<char*>(model->compute_copy().raw()) + model->compute_copy().nbytes());
      const train::StepStatus skipped = step(true);
      EXPECT_FALSE(skipped.applied) << name;
      EXPECT_EQ(skipped.step, 0) << name;
      EXPECT_EQ(opt->steps(), 0) << name << ": a skipped step is not counted";
      EXPECT_FALSE(opt->pending()) << name;
      EXPECT_EQ(copy_of(model->params()), p0) << name << ": the gate left the parameters";
      for (Tensor* t : opt->state()) EXPECT_EQ(copy_of(*t), std::vector<float>(t->numel(), 0.f)) << name;
      EXPECT_EQ(0, std::memcmp(model->compute_copy().raw(), c0.data(), c0.size())) << name << ": and the fp16 copy";
      const train::StepStatus next = step(false);
      EXPECT_TRUE(next.applied) << name;
      EXPECT_EQ(next.step, 1) << name;
      EXPECT_EQ(opt->steps(), 1) << name;
      // The same first step by a fresh optimizer from the same parameters and gradients.
      Tensor ref = Tensor::empty(rep.pool(), {model->num_params()}, DType::f32, MemTag::params);
      std::memcpy(ref.raw(), p0.data(), p0.size() * sizeof(float));
      auto fresh = make();
      fresh->step(ref, model->grads(), 0.1f);
      EXPECT_EQ(copy_of(ref), copy_of(model->params())) << name << ": the step after the skip is a first step";
      for (size_t k = 0; k < opt->state().size(); ++k)
        EXPECT_EQ(copy_of(*fresh->state()[k]), copy_of(*opt->state()[k])) << name << ": state " << k;
    });
  }
}

namespace {
// An identity layer whose backward, when told to, writes +inf into the gradient it passes on:
// a non-finite gradient on one replica only, while every loss stays finite.
class GradPoison : public nn::Layer {
 public:
  explicit GradPoison(const bool* armed) : Layer("test.grad_poison"), armed_(armed) {}
  Tensor forward(nn::Context& ctx, const Tensor& x) override {
    Tensor y = ctx.alloc(x.shape(), MemTag::activations, x.dtype());
    std::memcpy(y.raw(), x.raw(), x.nbytes());
    return y;
  }
  Tensor backward(nn::Context&, const Tensor& dy) override {
    if (*armed_) {
      if (dy.dtype() == DType::f32) {
        dy.data<float>()[0] = std::numeric_limits<float>::infinity();
      } else {
        const uint16_t inf = dy.dtype() == DType::f16 ? 0x7C00 : 0x7F80;  // +inf in f16 / bf16
        std::memcpy(dy.raw(), &inf, sizeof inf);
      }
    }
    return dy;
  }
  Shape output_shape(const Shape& in) const override { return in; }

 private:
  const bool* armed_;
};
}  // namespace

TEST(MixedPrecision, NonFiniteGradientOnOneReplicaWithFiniteLossSkipsEverywhere) {
  // The loss is finite on both replicas; only rank 1's backward produces an inf. The verdict can
  // come from the gradients' finite check alone, and it must be the same on both replicas.
  for (DType act : {DType::f16, DType::bf16}) {
    parallel::ReplicaGroup group(parse_devices("cpu:2"), {});
    std::vector<train::StepStatus> planted(2);
    std::vector<optim::DynamicLossScaler::State> scaler_state(2);
    std::vector<std::vector<float>> params_after(2), moment_after(2);
    group.run([&](parallel::Replica& rep) {
      bool armed = false;
      auto net = std::make_unique<nn::Sequential>("net");
      net->emplace<nn::Conv2d>("conv", 1, 4, 3, 1, 1);
      net->emplace<GradPoison>(&armed);
      net->emplace<nn::GlobalAvgPool>("pool");
      net->emplace<nn::Linear>("fc", 4, 10);
      nn::Model model("poisoned", std::move(net), Shape{8, 8, 1}, 10);
      model.materialize(rep.pool(), 1, act);
      optim::Sgd sgd(model.registry(), model.num_params(), rep.pool(), {.momentum = 0.9f});
      optim::DynamicLossScaler scaler({.init_scale = 1024.f, .growth_interval = 1000});
      train::ReplicaStep rs(rep, model, sgd, {.accumulation = 1, .micro_batch = 8, .activations = act, .scaler = &scaler});
      Tensor x, y;
      auto step = [&](bool plant) {
        random_batch(rep.pool(), 8, 10 + rep.rank(), x, y);
        armed = plant && rep.rank() == 1;
        rs.zero_grad();
        rs.micro_step(x, y, true);
        armed = false;
        return rs.apply(0.1f);
      };
      EXPECT_TRUE(step(false).applied);
      const auto params = copy_of(model.params()), moment = copy_of(*sgd.state()[0]);
      const int64_t steps_before = sgd.steps();
      planted[rep.rank()] = step(true);
      EXPECT_TRUE(std::isfinite(planted[rep.rank()].loss)) << "the loss stays finite: only the gradient check can see it";
      EXPECT_EQ(copy_of(model.params()), params) << "rank " << rep.rank() << ": the master weights are unchanged";
      EXPECT_EQ(copy_of(*sgd.state()[0]), moment) << "rank " << rep.rank() << ": and the momentum";
      EXPECT_EQ(sgd.steps(), steps_before) << "and the step count";
      scaler_state[rep.rank()] = scaler.state();
      params_after[rep.rank()] = copy_of(model.params());
      moment_after[rep.rank()] = copy_of(*sgd.state()[0]);
      train::StepStatus next = step(false);
      EXPECT_TRUE(next.applied) << "training goes on after the skip";
      EXPECT_EQ(next.step, steps_before + 1);
    });
    const char* name = dtype_name(act);
    EXPECT_FALSE(planted[0].applied) << name << ": rank 0's own gradients were finite, yet it skipped with rank 1";
    EXPECT_FALSE(planted[1].applied) << name;
    EXPECT_EQ(params_after[0], params_after[1]) << name << ": the replicas still agree";
    EXPECT_EQ(moment_after[0], moment_after[1]) << name;
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(scaler_state[r].scale, 512.f) << name << " rank " << r << ": backed off once";
      EXPECT_EQ(scaler_state[r].skipped, 1) << name << " rank " << r;
      EXPECT_EQ(scaler_state[r].good, 0) << name << " rank " << r << ": the good-step count restarts";
    }
  }
}

TEST(MixedPrecision, SixteenBitActivationsHalveActivationMemory) {
  std::map<DType, size_t> peak;
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    PoolOptions po;
    auto pool = make_pool({DeviceKind::cpu, 0}, po);
    auto model = models::make_resnet({});
    model->materialize(*pool, 1, dt);
    Tensor x, y;
    x = Tensor::zeros(*pool, {32, 28, 28, 1}, DType::f32, MemTag::other);
    pool->reset_peaks();
    nn::Context ctx(*pool, ops::backend_for(pool->device()), true);
    ctx.act_dtype = dt;
    Tensor logits = model->forward(ctx, x);
    Tensor d = ctx.alloc(logits.shape());
    ops::backend_for(pool->device()).fill(d, 0.01f);
    model->backward(ctx, d);
    peak[dt] = pool->stats().tags[static_cast<int>(MemTag::activations)].peak_in_use;
  }
  std::printf("activation peak: fp32 %zu, fp16 %zu, bf16 %zu bytes\n", peak[DType::f32], peak[DType::f16], peak[DType::bf16]);
  EXPECT_LE(peak[DType::f16], 0.55 * peak[DType::f32]);
  EXPECT_LE(peak[DType::bf16], 0.55 * peak[DType::f32]);
}

namespace {
std::vector<std::string> accum_sets(int replicas, int64_t micro, const std::string& dir) {
  return {"model.width=4", "model.freeze_bn=true", "data.dataset=synthetic", "data.synthetic_shape=[8,8,1]",
          "data.synthetic_size=512", "data.mean=[0.5]", "data.std=[0.25]", "train.global_batch=32",
          "train.micro_batch=" + std::to_string(micro), "train.max_steps=4", "train.eval=false",
          "train.run_dir=" + dir, "optim.schedule=constant", "optim.lr=0.05", "parallel.check_every=1",
          "parallel.devices=cpu:" + std::to_string(replicas)};
}
struct Trained {
  std::vector<float> params, buffers;
};
Trained trained(const std::vector<std::string>& sets) {
  train::Trainer t(train::parse_config("", "test", sets), {.print = false, .on_step = nullptr});
  t.fit();
  return {copy_of(t.model(0).params()), copy_of(t.model(0).buffers())};
}
}  // namespace

TEST(Accumulation, MicroStepsEqualOneLargeBatchOnOneAndTwoReplicas) {
  // Batch norm frozen (running statistics) so a micro-batch normalises exactly as the large batch
  // does; then k micro-steps of b and one step of k*b differ only by summation order.
  const std::string dir = ::testing::TempDir() + "/accum_frozen";
  const Trained one_big = trained(accum_sets(1, 32, dir));
  const Trained one_acc = trained(accum_sets(1, 8, dir));  // 4 micro-steps
  const Trained two_acc = trained(accum_sets(2, 4, dir));  // 2 replicas x 4 micro-steps
  const Trained two_big = trained(accum_sets(2, 16, dir));
  using replica::testing::max_rel_diff;
  std::printf("accumulation vs one batch: 1 replica %.2e, 2 replicas %.2e, 2 replicas no accumulation %.2e\n",
              max_rel_diff(one_acc.params, one_big.params), max_rel_diff(two_acc.params, one_big.params),
              max_rel_diff(two_big.params, one_big.params));
  EXPECT_LT(max_rel_diff(one_acc.params, one_big.params), 1e-5);
  EXPECT_LT(max_rel_diff(two_acc.params, one_big.params), 1e-5);
  EXPECT_LT(max_rel_diff(two_big.params, one_big.params), 1e-5);
  // Frozen batch norm never updates its running statistics, however the batch is cut.
  for (const Trained* t : {&one_acc, &two_acc, &two_big}) EXPECT_EQ(t->buffers, one_big.buffers);
  auto other = accum_sets(1, 8, dir);
  other.push_back("optim.lr=0.06");
  EXPECT_GT(max_rel_diff(trained(other).params, one_big.params), 1e-4) << "the comparison can fail";
}

TEST(Accumulation, GlobalBatchThatDoesNotDivideNamesTheNumbers) {
  auto sets = accum_sets(2, 12, ::testing::TempDir() + "/bad");
  try {
    train::Trainer t(train::parse_config("", "test", sets), {.print = false, .on_step = nullptr});
    FAIL();
  } catch (const ConfigError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("global_batch 32"), std::string::npos) << m;
    EXPECT_NE(m.find("micro_batch 12"), std::string::npos) << m;
    EXPECT_NE(m.find("2 replicas"), std::string::npos) << m;
  }
}

TEST(MixedPrecision, NanLossInFp32StopsNamingTheStep) {
  parallel::ReplicaGroup group(parse_devices("cpu:1"), {});
  try {
    group.run([&](parallel::Replica& rep) {
      auto model = tiny_resnet();
      model->materialize(rep.pool(), 1);
      optim::Sgd sgd(model->registry(), model->num_params(), rep.pool(), {});
      train::ReplicaStep rs(rep, *model, sgd, {.accumulation = 1, .micro_batch = 4});
      Tensor x, y;
      random_batch(rep.pool(), 4, 1, x, y);
      rs.zero_grad();
      rs.micro_step(x, y, true);
      rs.apply(0.1f);
      x.data<float>()[3] = std::nanf("");
      rs.zero_grad();
      rs.micro_step(x, y, true);
      rs.apply(0.1f);
    });
    FAIL() << "expected an error";
  } catch (const parallel::ReplicaError& e) {
    EXPECT_NE(std::string(e.what()).find("NaN at step 2"), std::string::npos) << e.what();
  }
}

TEST(MixedPrecision, Fp16AndBf16TrackFp32OnFashionMnist) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  std::map<std::string, double> acc;
  for (std::string p : {"fp32", "fp16", "bf16"}) {
    auto cfg = train::parse_config("", "test",
                                   {"model.width=8", "data.limit_train=6144", "data.limit_test=2000",
                                    "train.epochs=1", "train.global_batch=64", "optim.lr=0.05",
                                    "optim.warmup_epochs=0", "train.precision=" + p,
                                    "train.run_dir=" + ::testing::TempDir() + "/mp_" + p});
    train::Trainer t(cfg, {.print = false, .on_step = nullptr});
    acc[p] = t.fit().test.accuracy;
  }
  std::printf("1 epoch on 6144 images: fp32 %.4f, fp16 %.4f, bf16 %.4f\n", acc["fp32"], acc["fp16"], acc["bf16"]);
  EXPECT_GT(acc["fp32"], 0.6);
  // A short run is noisy; the full 3-epoch comparison (0.5 points) is in bench/RESULTS.md.
  EXPECT_NEAR(acc["fp16"], acc["fp32"], 0.03);
  EXPECT_NEAR(acc["bf16"], acc["fp32"], 0.03);
}

namespace {
// A layer with a bug: it keeps every output it produced.
class Hoarder : public nn::Layer {
 public:
  Hoarder() : Layer("leaky.hoarder") {}
  Tensor forward(nn::Context& ctx, const Tensor& x) override {
    Tensor y = ctx.alloc(x.shape());
    std::memcpy(y.raw(), x.raw(), x.nbytes());
    kept_.push_back(y);
    return y;
  }
  Tensor backward(nn::Context&, const Tensor& dy) override { return dy; }
  Shape output_shape(const Shape& in) const override { return in; }

 private:
  std::vector<Tensor> kept_;
};
}  // namespace

void three_steps(parallel::Replica& rep, train::ReplicaStep& rs) {
  Tensor x, y;
  random_batch(rep.pool(), 4, 1, x, y);
  for (int s = 0; s < 3; ++s) {
    rs.zero_grad();
    rs.micro_step(x, y, true);
    rs.apply(0.01f);
  }
}

TEST(Diagnostics, APlantedLeakIsNamedWithItsLayer) {
  parallel::ReplicaGroup group(parse_devices("cpu:1"), {});
  group.run([&](parallel::Replica& rep) {
    auto net = std::make_unique<nn::Sequential>("net");
    net->emplace<nn::Conv2d>("conv", 1, 4, 3, 1, 1);
    net->emplace<Hoarder>();
    net->emplace<nn::GlobalAvgPool>("pool");
    net->emplace<nn::Linear>("fc", 4, 10);
    nn::Model model("leaky", std::move(net), Shape{8, 8, 1}, 10);
    model.materialize(rep.pool(), 1);
    optim::Sgd sgd(model.registry(), model.num_params(), rep.pool(), {});
    train::ReplicaStep rs(rep, model, sgd, {.accumulation = 1, .micro_batch = 4});
    three_steps(rep, rs);
    const std::string& r = rs.leak_report();
    EXPECT_NE(r.find("activations grew"), std::string::npos) << r;
    EXPECT_NE(r.find("leaky.hoarder"), std::string::npos) << r;
  });
  // and a healthy model stays quiet
  group.run([&](parallel::Replica& rep) {
    auto model = tiny_resnet();
    model->materialize(rep.pool(), 1);
    optim::Sgd sgd(model->registry(), model->num_params(), rep.pool(), {});
    train::ReplicaStep rs(rep, *model, sgd, {.accumulation = 1, .micro_batch = 4});
    three_steps(rep, rs);
    EXPECT_EQ(rs.leak_report(), "");
  });
}
