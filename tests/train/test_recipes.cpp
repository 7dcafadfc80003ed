// The training recipes' arithmetic against PyTorch (tests/reference/make_recipe_fixtures.py,
// tests/fixtures/recipes_golden.bin): label smoothing's loss and gradient
// (F.cross_entropy(label_smoothing=e)), top-1 and top-5 (torch.topk), the poly schedule
// (torch.optim.lr_scheduler.PolynomialLR, alone and after a linear warm-up) and one update of the
// weights' moving average (torch.optim.swa_utils.AveragedModel, torchvision's EMA rule).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/pools.h"
#include "core/tensor.h"
#include "ops/backend.h"
#include "optim/schedule.h"
#include "support/fixture.h"
#include "train/config.h"
#include "train/ema.h"

using namespace replica;

namespace {

const auto& fixture() {
  static const auto f = replica::testing::load_fixture(std::string(REPLICA_SOURCE_DIR) + "/tests/fixtures/recipes_golden.bin");
  return f;
}

struct Logits {
  std::unique_ptr<MemoryPool> pool = make_pool(Device{DeviceKind::cpu, 0}, PoolOptions{});
  Tensor z, labels;
  int64_t N = 0, K = 0;
  Logits() {
    const auto& f = fixture();
    const auto& zt = f.at("logits");
    N = zt.shape[0];
    K = zt.shape[1];
    z = Tensor::empty(*pool, {N, K}, DType::f32, MemTag::other);
    std::copy(zt.data.begin(), zt.data.end(), z.data<float>());
    labels = Tensor::empty(*pool, {N}, DType::i32, MemTag::other);
    for (int64_t n = 0; n < N; ++n) labels.data<int32_t>()[n] = static_cast<int32_t>(f.at("labels").data[n]);
  }
};

}  // namespace

// The smoothed loss (the mean over the rows, as PyTorch reports it) and its gradient, for e = 0,
// 0.1 and 0.3: the backend's sum over the rows / N, and the backward with scale 1 / N.
TEST(Recipes, LabelSmoothingMatchesPyTorch) {
  Logits l;
  auto& be = ops::backend_for(Device{DeviceKind::cpu, 0});
  for (const char* tag : {"0", "0.1", "0.3"}) {
    const float e = std::stof(tag);
    Tensor probs = Tensor::empty(*l.pool, {l.N, l.K}, DType::f32, MemTag::other);
    Tensor sums = Tensor::zeros(*l.pool, {3}, DType::f32, MemTag::other);
    be.softmax_xent_accumulate(l.z, l.labels, probs, sums, e);
    const double want = fixture().at(std::string("loss_eps") + tag).data[0];
    EXPECT_NEAR(sums.data<float>()[0] / l.N, want, 2e-6 * std::abs(want)) << "label smoothing " << tag;
    Tensor d = Tensor::empty(*l.pool, {l.N, l.K}, DType::f32, MemTag::other);
    be.softmax_xent_backward(probs, l.labels, 1.f / static_cast<float>(l.N), d, e);
    const auto& g = fixture().at(std::string("grad_eps") + tag).data;
    double worst = 0;
    for (int64_t i = 0; i < l.N * l.K; ++i) worst = std::max(worst, std::abs(double(d.data<float>()[i]) - g[i]));
    EXPECT_LT(worst, 1e-7) << "gradient of the smoothed loss, e = " << tag;
  }
}

// Top-1 and top-5 per row, against torch.topk: one row at a time, so a miscount cannot hide in a
// sum (the fixture has a row whose label is not the argmax and one with a tie for the first place).
TEST(Recipes, TopOneAndTopFiveMatchPyTorch) {
  Logits l;
  auto& be = ops::backend_for(Device{DeviceKind::cpu, 0});
  int64_t top1 = 0, top5 = 0;
  for (int64_t n = 0; n < l.N; ++n) {
    Tensor probs = Tensor::empty(*l.pool, {1, l.K}, DType::f32, MemTag::other);
    const auto r = be.softmax_xent_forward(l.z.view(n * l.K, {1, l.K}), l.labels.view(n, {1}), probs);
    EXPECT_EQ(r.correct, static_cast<int64_t>(fixture().at("top1_hit").data[n])) << "row " << n;
    EXPECT_EQ(r.correct5, static_cast<int64_t>(fixture().at("top5_hit").data[n])) << "row " << n;
    top1 += r.correct;
    top5 += r.correct5;
  }
  EXPECT_LT(top1, top5) << "the fixture has rows right in the top 5 but not first";
  EXPECT_LT(top5, l.N) << "and rows outside the top 5";
  Tensor probs = Tensor::empty(*l.pool, {l.N, l.K}, DType::f32, MemTag::other);
  const auto all = be.softmax_xent_forward(l.z, l.labels, probs);
  EXPECT_EQ(all.correct, top1);
  EXPECT_EQ(all.correct5, top5);
}

// optim.schedule: poly. From the warm-up's end lr = min_lr + (lr - min_lr) (1 - t)^power, which is
// PyTorch's PolynomialLR (min_lr 0). replica's linear warm-up reaches the full rate on its last
// step (Goyal et al.; PyTorch's LinearLR one step later), so the warmed-up schedule is compared
// from the warm-up's end.
TEST(Recipes, PolyScheduleMatchesPyTorch) {
  for (const float power : {1.f, 2.f}) {
    const auto& want = fixture().at(power == 1.f ? "poly_p1" : "poly_p2").data;
    const optim::ScheduleOptions o{.kind = "poly", .base_lr = 2.f, .total_steps = 20, .power = power};
    optim::validate(o);
    for (size_t s = 0; s < want.size(); ++s)
      EXPECT_NEAR(optim::lr_at(o, static_cast<int64_t>(s)), want[s], 1e-6) << "power " << power << " step " << s;
  }
  const auto& want = fixture().at("poly_p2_warmup5").data;
  const optim::ScheduleOptions w{.kind = "poly", .base_lr = 2.f, .warmup_steps = 5, .warmup_start_factor = 0.1f,
                                 .total_steps = 20, .power = 2.f};
  for (size_t s = 5; s < want.size(); ++s) EXPECT_NEAR(optim::lr_at(w, static_cast<int64_t>(s)), want[s], 1e-6) << s;
  EXPECT_LT(optim::lr_at(w, 0), optim::lr_at(w, 4)) << "it warms up";
  const optim::ScheduleOptions floor{.kind = "poly", .base_lr = 2.f, .total_steps = 10, .min_lr = 1e-4f, .power = 2.f};
  EXPECT_NEAR(optim::lr_at(floor, 10), 1e-4, 1e-9) << "decays to min_lr";
  EXPECT_NEAR(optim::lr_at(floor, 5), 1e-4 + (2 - 1e-4) * 0.25, 1e-6);
}

// The recipe keys' bad values are errors naming the key and what to use.
TEST(Recipes, BadValuesAreNamedErrors) {
  for (const char* bad : {"train.label_smoothing=1", "train.label_smoothing=-0.1", "optim.poly_power=0",
                          "optim.schedule=polynomial", "train.ema_decay=1", "train.ema_decay=-0.5", "train.ema_every=0"}) {
    try {
      train::parse_config("", "test", {bad});
      ADD_FAILURE() << bad << " was accepted";
    } catch (const ConfigError& e) {
      const std::string key = std::string(bad).substr(0, std::string(bad).find('='));
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  }
  const auto c = train::parse_config("", "test", {"train.label_smoothing=0.1", "optim.schedule=poly", "optim.poly_power=2"});
  EXPECT_DOUBLE_EQ(c.train.label_smoothing, 0.1);
  EXPECT_EQ(c.optim.schedule, "poly");
}

// train.ema_decay: one update is torch.optim.swa_utils.AveragedModel's with torchvision's
// ExponentialMovingAverage rule (decay * avg + (1 - decay) * param); the schedule copies the
// model through the warm-up, then updates every `every` applied steps.
TEST(Recipes, MovingAverageMatchesPyTorchAndFollowsItsSchedule) {
  auto pool = make_pool(Device{DeviceKind::cpu, 0}, PoolOptions{});
  auto& be = ops::backend_for(Device{DeviceKind::cpu, 0});
  const auto& before = fixture().at("ema_before").data;
  const auto& param = fixture().at("ema_param").data;
  const auto& after = fixture().at("ema_after").data;
  const int64_t n = static_cast<int64_t>(before.size());
  Tensor ema = Tensor::empty(*pool, {n}, DType::f32, MemTag::other), p = Tensor::empty(*pool, {n}, DType::f32, MemTag::other);
  std::copy(before.begin(), before.end(), ema.data<float>());
  std::copy(param.begin(), param.end(), p.data<float>());
  train::ema_update(be, ema, p, 0.9f);
  for (int64_t i = 0; i < n; ++i)
    EXPECT_NEAR(ema.data<float>()[i], after[i], 2e-7 * (1 + std::abs(after[i]))) << "element " << i;

  Tensor w = Tensor::empty(*pool, {3}, DType::f32, MemTag::other), b = Tensor::empty(*pool, {2}, DType::f32, MemTag::other);
  auto set = [&](float v) {
    for (int i = 0; i < 3; ++i) w.data<float>()[i] = v;
    for (int i = 0; i < 2; ++i) b.data<float>()[i] = -v;
  };
  set(1.f);
  train::WeightEma avg(*pool, w, b, {.decay = 0.5, .every = 2, .warmup_steps = 2});
  EXPECT_EQ(avg.params().data<float>()[0], 1.f) << "it starts as the model";
  const float expect[][2] = {{2.f, 2.f}, {4.f, 4.f}, {8.f, 4.f}, {16.f, 10.f}, {32.f, 10.f}, {64.f, 37.f}};
  for (int64_t step = 1; step <= 6; ++step) {  // warm-up copies at 1, 2; updates at 4 and 6
    set(expect[step - 1][0]);
    avg.after_step(step, w, b);
    EXPECT_EQ(avg.params().data<float>()[2], expect[step - 1][1]) << "after step " << step;
    EXPECT_EQ(avg.buffers().data<float>()[1], -expect[step - 1][1]) << "the statistics too, after step " << step;
  }
}
