// Optimizer update rules against hand-computed values, the loss scaler's state machine, schedules
// and clipping.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>

#include "core/errors.h"
#include "core/pools.h"
#include "ops/backend.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"

using namespace replica;
using namespace replica::optim;

namespace {
// Two slots: a 2-element conv weight and a 1-element BN gamma, laid out at offsets 0 and 16.
struct Fixture {
  Fixture() : pool(make_pool({DeviceKind::cpu, 0}, PoolOptions{})) {
    reg.add_param({"w", {2}, nn::ParamKind::weight, nn::Init::zeros, 1, 0, nullptr, nullptr});
    reg.add_param({"g", {1}, nn::ParamKind::bn_gamma, nn::Init::ones, 1, 16, nullptr, nullptr});
    p = Tensor::zeros(*pool, {17}, DType::f32, MemTag::params);
    g = Tensor::zeros(*pool, {17}, DType::f32, MemTag::grads);
    set(p, {1.0f, -2.0f, 0.5f});
    set(g, {0.1f, 0.2f, -0.4f});
  }
  static void set(Tensor& t, std::vector<float> v) {
    t.data<float>()[0] = v[0];
    t.data<float>()[1] = v[1];
    t.data<float>()[16] = v[2];
  }
  float at(int i) const { return p.data<float>()[i]; }
  std::unique_ptr<MemoryPool> pool;
  nn::ParamRegistry reg;
  Tensor p, g;
};
}  // namespace

TEST(Sgd, NesterovCoupledWeightDecayByHand) {
  Fixture f;
  Sgd sgd(f.reg, 17, *f.pool, {.momentum = 0.9f, .nesterov = true, .weight_decay = 0.1f});
  sgd.step(f.p, f.g, 0.5f);
  // d = g + wd p = 0.1 + 0.1 = 0.2; buf = d; nesterov d + m buf = 0.38; p = 1 - 0.5 * 0.38
  EXPECT_FLOAT_EQ(f.at(0), 0.81f);
  sgd.step(f.p, f.g, 0.5f);
  // d = 0.1 + 0.081 = 0.181; buf = 0.9*0.2 + 0.181 = 0.361; step d + 0.9 buf = 0.5059
  EXPECT_NEAR(f.at(0), 0.81f - 0.5f * 0.5059f, 1e-6);
  Fixture h;
  Sgd dec(h.reg, 17, *h.pool, {.momentum = 0.f, .nesterov = false, .weight_decay = 0.1f, .decoupled = true,
                               .no_decay_bn_bias = true});
  dec.step(h.p, h.g, 0.5f);
  EXPECT_FLOAT_EQ(h.at(0), 1.0f - 0.5f * 0.1f - 0.5f * 0.1f * 1.0f);
  EXPECT_FLOAT_EQ(h.at(16), 0.5f + 0.5f * 0.4f) << "no decay on BN gamma";
}

TEST(AdamW, MatchesHandComputedUpdates) {
  Fixture f;
  AdamW opt(f.reg, 17, *f.pool, {.beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f});
  opt.step(f.p, f.g, 0.1f);
  // step 1: p *= 1 - lr wd; m = 0.1 g, v = 0.001 g^2; mhat = g, vhat = g^2: p -= lr * g/|g|
  EXPECT_NEAR(f.at(0), 1.0 * (1 - 0.001) - 0.1, 1e-6);
  EXPECT_NEAR(f.at(1), -2.0 * (1 - 0.001) - 0.1, 1e-6);
  EXPECT_NEAR(f.at(16), 0.5 * (1 - 0.001) + 0.1, 1e-6);
  Fixture::set(f.g, {0.3f, 0.2f, -0.4f});
  double p0 = f.at(0);
  opt.step(f.p, f.g, 0.1f);
  double m = 0.9 * 0.01 + 0.1 * 0.3, v = 0.999 * 0.001 * 0.01 + 0.001 * 0.09;
  double mhat = m / (1 - 0.81), vhat = v / (1 - 0.999 * 0.999);
  EXPECT_NEAR(f.at(0), p0 * (1 - 0.001) - 0.1 * mhat / (std::sqrt(vhat) + 1e-8), 1e-6);
  EXPECT_EQ(opt.steps(), 2);
}

TEST(Lars, TrustRatioOnWeightsPlainMomentumOnBn) {
  Fixture f;
  Lars opt(f.reg, 17, *f.pool, {.momentum = 0.9f, .weight_decay = 0.01f, .trust_coefficient = 0.001f, .eps = 0.f});
  opt.step(f.p, f.g, 1.0f);
  const double wn = std::sqrt(1.0 + 4.0), gn = std::sqrt(0.01 + 0.04);
  const double local = 0.001 * wn / (gn + 0.01 * wn);
  EXPECT_NEAR(f.at(0), 1.0 - local * (0.1 + 0.01 * 1.0), 1e-7);
  EXPECT_NEAR(f.at(1), -2.0 - local * (0.2 + 0.01 * -2.0), 1e-7);
  EXPECT_NEAR(f.at(16), 0.5 - 1.0 * -0.4, 1e-7) << "BN gamma: no trust ratio, no weight decay";
}

// The 16-bit compute copy written in the update's own pass (Optimizer::step's `copy`) has the bits
// of the update followed by a cast, and the parameters and state are unchanged by writing it: every
// optimizer, both 16-bit types, a buffer over several of the CPU loop's 4096-element blocks, and a
// shard's range (only its part of the copy is written).
TEST(FusedComputeCopy, TheUpdateWritesTheCastBits) {
  auto pool = make_pool({DeviceKind::cpu, 0}, PoolOptions{});
  auto& be = ops::backend_for({DeviceKind::cpu, 0});
  nn::ParamRegistry reg;
  reg.add_param({"a.weight", {6000}, nn::ParamKind::weight, nn::Init::zeros, 1, 0, nullptr, nullptr});
  reg.add_param({"a.bn.weight", {37}, nn::ParamKind::bn_gamma, nn::Init::ones, 1, 6000, nullptr, nullptr});
  reg.add_param({"b.weight", {5000}, nn::ParamKind::weight, nn::Init::zeros, 1, 6048, nullptr, nullptr});
  const int64_t total = 11048;  // slots on 16-element boundaries, as nn::Model lays them out
  auto bits = [](const Tensor& t) {
    std::string b(static_cast<size_t>(t.nbytes()), '\0');
    std::memcpy(b.data(), t.raw(), b.size());
    return b;
  };
  for (DType dt : {DType::f16, DType::bf16}) {
    for (const std::string name : {"sgd", "sgd-decoupled", "adamw", "lars"}) {
      for (ShardRange range : {ShardRange{}, ShardRange{6000, total}}) {
        const std::string what = name + " " + dtype_name(dt) + (range.hi < 0 ? "" : " shard [6000, 11048)");
        auto make = [&]() -> std::unique_ptr<Optimizer> {
          if (name == "adamw") return std::make_unique<AdamW>(reg, total, *pool, AdamWOptions{}, range);
          if (name == "lars") return std::make_unique<Lars>(reg, total, *pool, LarsOptions{}, range);
          SgdOptions o;
          o.decoupled = name == "sgd-decoupled";
          o.no_decay_bn_bias = o.decoupled;
          return std::make_unique<Sgd>(reg, total, *pool, o, range);
        };
        std::mt19937 rng(7);
        std::normal_distribution<float> d(0.f, 1.f);
        Tensor p1 = Tensor::empty(*pool, {total}, DType::f32, MemTag::params);
        Tensor g = Tensor::empty(*pool, {total}, DType::f32, MemTag::grads);
        for (int64_t i = 0; i < total; ++i) p1.data<float>()[i] = d(rng), g.data<float>()[i] = 0.01f * d(rng);
        Tensor p2 = Tensor::empty(*pool, {total}, DType::f32, MemTag::params);
        copy_tensor(p1, p2);
        Tensor fused = Tensor::empty(*pool, {total}, dt, MemTag::params);
        Tensor cast = Tensor::empty(*pool, {total}, dt, MemTag::params);
        be.cast(p1, fused);  // the copy as materialize leaves it
        copy_tensor(fused, cast);
        auto a = make(), b = make();
        for (int step = 0; step < 3; ++step) {
          a->step(p1, g, 0.1f, fused);
          b->step(p2, g, 0.1f);
          be.cast(p2, cast);  // what refresh_compute_copy does after an update
          ASSERT_EQ(bits(p1), bits(p2)) << what << ": the parameters moved differently at step " << step;
          ASSERT_EQ(bits(fused), bits(cast)) << what << ": the copy differs from a cast at step " << step;
          for (size_t k = 0; k < a->state().size(); ++k)
            ASSERT_EQ(bits(*a->state()[k]), bits(*b->state()[k])) << what << ": state " << k;
        }
      }
    }
  }
  // A copy of another size or an f32 one is refused, naming the op.
  Tensor p = Tensor::zeros(*pool, {total}, DType::f32, MemTag::params), g = p;
  Sgd sgd(reg, total, *pool, SgdOptions{});
  EXPECT_THROW(sgd.step(p, g, 0.1f, Tensor::zeros(*pool, {total}, DType::f32, MemTag::params)), ShapeError);
}

// Optimizer::stage: the step's values (the learning rate, what the step count decides) written to
// the device and read there by the update give the bits of the same update given numbers, over
// steps whose learning rate changes and with a skipped step (gate 0, settle(false): the next step
// is again a first step for SGD's momentum and AdamW's bias correction). An update for another lr
// than the staged one, and a replay (Optimizer::replayed) with nothing staged for the step, are
// Errors; a replay staged for its step waits for settle() like a gated step.
TEST(StagedStepValues, AStagedUpdateGivesTheBitsOfOneGivenNumbers) {
  auto pool = make_pool({DeviceKind::cpu, 0}, PoolOptions{});
  nn::ParamRegistry reg;
  reg.add_param({"a.weight", {300}, nn::ParamKind::weight, nn::Init::zeros, 1, 0, nullptr, nullptr});
  reg.add_param({"a.bn.weight", {20}, nn::ParamKind::bn_gamma, nn::Init::ones, 1, 304, nullptr, nullptr});
  const int64_t total = 324;
  auto bits = [](const Tensor& t) { return std::string(static_cast<const char*>(t.raw()), t.nbytes()); };
  for (const std::string name : {"sgd", "sgd-decoupled", "adamw", "lars"}) {
    auto make = [&]() -> std::unique_ptr<Optimizer> {
      if (name == "adamw") return std::make_unique<AdamW>(reg, total, *pool, AdamWOptions{});
      if (name == "lars") return std::make_unique<Lars>(reg, total, *pool, LarsOptions{});
      SgdOptions o;
      o.decoupled = name == "sgd-decoupled";
      return std::make_unique<Sgd>(reg, total, *pool, o);
    };
    std::mt19937 rng(11);
    std::normal_distribution<float> d(0.f, 1.f);
    Tensor p1 = Tensor::empty(*pool, {total}, DType::f32, MemTag::params);
    Tensor g = Tensor::empty(*pool, {total}, DType::f32, MemTag::grads);
    for (int64_t i = 0; i < total; ++i) p1.data<float>()[i] = d(rng), g.data<float>()[i] = 0.01f * d(rng);
    Tensor p2 = Tensor::empty(*pool, {total}, DType::f32, MemTag::params);
    copy_tensor(p1, p2);
    const Tensor open = Tensor::zeros(*pool, {1}, DType::f32, MemTag::other);
    const Tensor shut = Tensor::zeros(*pool, {1}, DType::f32, MemTag::other);
    open.data<float>()[0] = 1.f;
    auto staged = make(), given = make();
    const float lrs[] = {0.1f, 0.07f, 0.05f, 0.02f, 0.01f};
    for (int step = 0; step < 5; ++step) {
      const bool apply = step != 0;  // the first step skipped: the next one starts the state
      staged->stage(lrs[step]);
      staged->step_gated(p1, g, lrs[step], Tensor(), apply ? open : shut);
      staged->settle(apply);
      if (apply) given->step(p2, g, lrs[step]);
      ASSERT_EQ(bits(p1), bits(p2)) << name << ": parameters at step " << step;
      for (size_t k = 0; k < staged->state().size(); ++k)
        ASSERT_EQ(bits(*staged->state()[k]), bits(*given->state()[k])) << name << ": state " << k << " at step " << step;
      ASSERT_EQ(staged->steps(), given->steps());
    }
    staged->stage(0.5f);
    EXPECT_THROW(staged->step_gated(p1, g, 0.25f, Tensor(), open), Error) << name << ": another lr than the staged one";
    EXPECT_FALSE(staged->pending());
    EXPECT_THROW(staged->replayed(0.25f), Error) << name;
    staged->replayed(0.5f);
    EXPECT_TRUE(staged->pending());
    EXPECT_THROW(staged->stage(0.5f), Error) << name << ": staging while a replayed update waits";
    staged->settle(true);
    EXPECT_EQ(staged->steps(), given->steps() + 1);
    EXPECT_THROW(staged->replayed(0.5f), Error) << name << ": the values were staged for the step before";
  }
}

// The optimizers update every group in one call through a table with one entry per 16 elements
// (ops::ChunkClasses), which needs each slot to start on a chunk boundary: a registry laid out
// otherwise is refused by name at construction, not updated with a neighbour's coefficients.
TEST(OptimizerGroups, ASlotOffAChunkBoundaryIsRefused) {
  auto pool = make_pool({DeviceKind::cpu, 0}, PoolOptions{});
  nn::ParamRegistry reg;
  reg.add_param({"a.weight", {20}, nn::ParamKind::weight, nn::Init::zeros, 1, 0, nullptr, nullptr});
  reg.add_param({"a.bn.weight", {4}, nn::ParamKind::bn_gamma, nn::Init::ones, 1, 20, nullptr, nullptr});
  for (const std::string name : {"sgd", "adamw", "lars"}) {
    try {
      if (name == "sgd") Sgd(reg, 24, *pool, SgdOptions{});
      else if (name == "adamw") AdamW(reg, 24, *pool, AdamWOptions{});
      else Lars(reg, 24, *pool, LarsOptions{});
      ADD_FAILURE() << name << " accepted a slot at flat element 20";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("a.bn.weight starts at flat element 20"), std::string::npos)
          << name << ": " << e.what();
    }
  }
}

TEST(Clip, GlobalNormScalesDown) {
  Fixture f;
  double n = clip_grad_norm(f.g, 0.1);
  EXPECT_NEAR(n, std::sqrt(0.01 + 0.04 + 0.16), 1e-6);
  EXPECT_NEAR(clip_grad_norm(f.g, 0), 0.1, 1e-5) << "after clipping the norm is 0.1";
}

TEST(LossScaler, GrowthAfterTheIntervalBackoffFloorHysteresis) {
  DynamicLossScaler s({.init_scale = 1024.f, .growth_interval = 3, .min_scale = 256.f});
  EXPECT_TRUE(s.update(true, 1));
  EXPECT_TRUE(s.update(true, 2));
  EXPECT_EQ(s.scale(), 1024.f);
  s.update(true, 3);
  EXPECT_EQ(s.scale(), 2048.f) << "x2 after 3 good steps";
  EXPECT_FALSE(s.update(false, 4));
  EXPECT_EQ(s.scale(), 1024.f) << "x0.5 on overflow";
  EXPECT_EQ(s.good_steps(), 0) << "an overflow restarts the growth count";
  s.update(false, 5);
  s.update(false, 6);
  EXPECT_EQ(s.scale(), 256.f) << "floor";
  s.update(false, 7);
  EXPECT_EQ(s.scale(), 256.f);
  EXPECT_EQ(s.skipped(), 4);

  DynamicLossScaler h({.init_scale = 1024.f, .hysteresis = 2});
  h.update(false, 1);
  EXPECT_EQ(h.scale(), 1024.f) << "hysteresis 2 tolerates one overflow";
  h.update(false, 2);
  EXPECT_EQ(h.scale(), 512.f);
  h.update(true, 3);
  h.update(false, 4);
  EXPECT_EQ(h.scale(), 512.f) << "a good step restores the tolerance";

  DynamicLossScaler fixed({.dynamic = false, .init_scale = 128.f, .growth_interval = 1});
  fixed.update(true, 1);
  fixed.update(false, 2);
  EXPECT_EQ(fixed.scale(), 128.f) << "static scale never moves";
}

TEST(LossScaler, StuckAtTheFloorIsAnError) {
  DynamicLossScaler s({.init_scale = 2.f, .min_scale = 1.f, .max_floor_overflows = 3});
  s.update(false, 1);  // 2 -> 1
  s.update(false, 2);
  s.update(false, 3);
  try {
    s.update(false, 4);
    FAIL() << "expected TrainingError";
  } catch (const TrainingError& e) {
    EXPECT_NE(std::string(e.what()).find("floor"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("step 4"), std::string::npos);
  }
}

TEST(Schedule, WarmupCosineStep) {
  ScheduleOptions c{.kind = "cosine", .base_lr = 1.f, .warmup_steps = 10, .warmup_start_factor = 0.f, .total_steps = 110};
  EXPECT_NEAR(lr_at(c, 0), 0.1, 1e-6);
  EXPECT_NEAR(lr_at(c, 9), 1.0, 1e-6);
  EXPECT_NEAR(lr_at(c, 60), 0.5, 1e-6);
  EXPECT_NEAR(lr_at(c, 110), 0.0, 1e-6);
  ScheduleOptions st{.kind = "step", .base_lr = 1.f, .milestones = {5, 8}, .gamma = 0.1f};
  EXPECT_NEAR(lr_at(st, 4), 1.0, 1e-6);
  EXPECT_NEAR(lr_at(st, 5), 0.1, 1e-6);
  EXPECT_NEAR(lr_at(st, 9), 0.01, 1e-7);
  EXPECT_NEAR(scaled_lr(0.1f, 1024), 0.4, 1e-6);
  EXPECT_THROW(validate({.kind = "linear"}), ConfigError);
}
