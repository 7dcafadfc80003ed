// The training recipes' arithmetic against PyTorch (tests/reference/make_recipe_fixtures.py,
// tests/fixtures/recipes_golden.bin): label smoothing's loss and gradient
// (F.cross_entropy(label_smoothing=e)), top-1 and top-5 (torch.topk), the poly schedule
// (torch.optim.lr_scheduler.PolynomialLR, alone and after a linear warm-up) and one update of the
// weights' moving average (torch.optim.swa_utils.AveragedModel, torchvision's EMA rule); mixup and
// cutmix in pairs (data/mixing.h): the soft target's loss and gradient, the mixed images, and the
// draws being a pure function of (seed, epoch, index) whatever the replica count.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/pools.h"
#include "core/tensor.h"
#include "data/loader.h"
#include "data/mixing.h"
#include "ops/backend.h"
#include "optim/schedule.h"
#include "support/fixture.h"
#include "train/config.h"
#include "train/ema.h"
#include "train/trainer.h"

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
                          "optim.schedule=polynomial", "train.ema_decay=1", "train.ema_decay=-0.5", "train.ema_every=0",
                          "data.mixup_alpha=-1", "data.cutmix_alpha=-0.5", "data.mix_prob=1.5", "data.mix_switch_prob=-0.1",
                          "data.mix_off_epoch=-1"}) {
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

namespace {
// Labels [N, 2] from the fixture's labels and its per-pair weights.
Tensor mixed_labels(MemoryPool& pool, const Tensor& labels, const std::vector<float>& pair_q) {
  const int64_t N = labels.numel();
  Tensor t = Tensor::empty(pool, {N, 2}, DType::i32, MemTag::other);
  for (int64_t n = 0; n < N; ++n) {
    t.data<int32_t>()[2 * n] = labels.data<int32_t>()[n];
    t.data<int32_t>()[2 * n + 1] = static_cast<int32_t>(pair_q[n / 2]);
  }
  return t;
}
}  // namespace

// Mixed rows' loss and gradient against F.cross_entropy with the probability target torchvision's
// v2.MixUp builds (w onehot(y) + (1 - w) onehot(partner's y)), smoothed and not; the weights
// include 1 (an unmixed pair), 1/2 and 0.
TEST(Recipes, MixedTargetsMatchPyTorch) {
  Logits l;
  auto& be = ops::backend_for(Device{DeviceKind::cpu, 0});
  const Tensor lab = mixed_labels(*l.pool, l.labels, fixture().at("mix_weight_q").data);
  for (const char* tag : {"0", "0.1"}) {
    const float e = std::stof(tag);
    Tensor probs = Tensor::empty(*l.pool, {l.N, l.K}, DType::f32, MemTag::other);
    Tensor sums = Tensor::zeros(*l.pool, {3}, DType::f32, MemTag::other);
    be.softmax_xent_accumulate(l.z, lab, probs, sums, e);
    const double want = fixture().at(std::string("mix_loss_eps") + tag).data[0];
    EXPECT_NEAR(sums.data<float>()[0] / l.N, want, 2e-6 * std::abs(want)) << "mixed, smoothing " << tag;
    Tensor d = Tensor::empty(*l.pool, {l.N, l.K}, DType::f32, MemTag::other);
    be.softmax_xent_backward(probs, lab, 1.f / static_cast<float>(l.N), d, e);
    const auto& g = fixture().at(std::string("mix_grad_eps") + tag).data;
    double worst = 0;
    for (int64_t i = 0; i < l.N * l.K; ++i) worst = std::max(worst, std::abs(double(d.data<float>()[i]) - g[i]));
    EXPECT_LT(worst, 1e-7) << "gradient of the mixed target, e = " << tag;
  }
  // Top-1 counts the label of the larger weight: with weight 0, the partner's.
  Tensor probs = Tensor::empty(*l.pool, {l.N, l.K}, DType::f32, MemTag::other);
  const auto r = be.softmax_xent_forward(l.z, lab, probs);
  int64_t want1 = 0;
  const auto& q = fixture().at("mix_weight_q").data;
  for (int64_t n = 0; n < l.N; ++n) {
    const int64_t counted = 2 * q[n / 2] >= (1 << 24) ? n : (n ^ 1);
    int64_t arg = 0;
    for (int64_t k = 1; k < l.K; ++k)
      if (l.z.data<float>()[n * l.K + k] > l.z.data<float>()[n * l.K + arg]) arg = k;
    want1 += arg == l.labels.data<int32_t>()[counted];
  }
  EXPECT_EQ(r.correct, want1);
  // Mixed labels pair rows: an odd row count and a weight outside [0, 2^24] are named errors.
  Tensor bad = mixed_labels(*l.pool, l.labels, q);
  bad.data<int32_t>()[3] = (1 << 24) + 1;
  EXPECT_THROW(be.softmax_xent_forward(l.z, bad, probs), ShapeError);
  Tensor odd = Tensor::empty(*l.pool, {l.N - 1, 2}, DType::i32, MemTag::other);
  EXPECT_THROW(be.softmax_xent_forward(l.z.view(0, {l.N - 1, l.K}), odd, probs.view(0, {l.N - 1, l.K})), ShapeError);
}

// A weight of 1 (an unmixed pair, or an epoch after data.mix_off_epoch) gives the bits of plain
// labels: loss sums, counts, probabilities and gradient, smoothed and not.
TEST(Recipes, AWeightOfOneGivesTheUnmixedBits) {
  Logits l;
  auto& be = ops::backend_for(Device{DeviceKind::cpu, 0});
  const Tensor ones = mixed_labels(*l.pool, l.labels, std::vector<float>(l.N / 2, float(1 << 24)));
  for (float e : {0.f, 0.1f}) {
    Tensor p[2], s[2], d[2];
    const Tensor* lab[2] = {&l.labels, &ones};
    for (int i = 0; i < 2; ++i) {
      p[i] = Tensor::empty(*l.pool, {l.N, l.K}, DType::f32, MemTag::other);
      s[i] = Tensor::zeros(*l.pool, {3}, DType::f32, MemTag::other);
      d[i] = Tensor::empty(*l.pool, {l.N, l.K}, DType::f32, MemTag::other);
      be.softmax_xent_accumulate(l.z, *lab[i], p[i], s[i], e);
      be.softmax_xent_backward(p[i], *lab[i], 0.37f, d[i], e);
    }
    EXPECT_EQ(0, std::memcmp(s[0].raw(), s[1].raw(), s[0].nbytes())) << "loss and counts, e = " << e;
    EXPECT_EQ(0, std::memcmp(p[0].raw(), p[1].raw(), p[0].nbytes()));
    EXPECT_EQ(0, std::memcmp(d[0].raw(), d[1].raw(), d[0].nbytes())) << "gradient, e = " << e;
  }
}

// The images: mixup both ways and cutmix's exchanged box, against the fixture's torch arithmetic.
TEST(Recipes, MixupAndCutmixImagesMatchPyTorch) {
  const auto& f = fixture();
  const int64_t H = 6, W = 5, C = 3;
  auto check = [&](const data::MixDraw& d, const char* wa, const char* wb) {
    std::vector<float> a = f.at("mix_a").data, b = f.at("mix_b").data;
    data::apply_mix(d, a.data(), b.data(), H, W, C);
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_NEAR(a[i], f.at(wa).data[i], 1e-7) << wa << " " << i;
      EXPECT_NEAR(b[i], f.at(wb).data[i], 1e-7) << wb << " " << i;
    }
  };
  data::MixDraw mixup{.kind = data::MixKind::mixup, .weight_q = 5033165};
  check(mixup, "mixup_a", "mixup_b");
  data::MixDraw cutmix{.kind = data::MixKind::cutmix, .weight_q = 0, .y0 = 1, .y1 = 4, .x0 = 2, .x1 = 5};
  check(cutmix, "cutmix_a", "cutmix_b");
}

// The draws: a pure function of (seed, epoch, first index); Beta(a, a)'s mean and variance; the
// probability of mixing, the switch between mixup and cutmix, cutmix's lambda following its
// clipped box, and the epoch after which mixing stops.
TEST(Recipes, MixingDrawsArePureAndFollowTheirOptions) {
  for (double a : {0.2, 1.0, 4.0}) {
    const int n = 40000;
    double m = 0, v = 0;
    for (int i = 0; i < n; ++i) {
      const double x = data::beta_symmetric(a, static_cast<uint64_t>(i) * 7919u);
      ASSERT_TRUE(x >= 0 && x <= 1);
      m += x;
      v += (x - 0.5) * (x - 0.5);
    }
    m /= n;
    v /= n;
    EXPECT_NEAR(m, 0.5, 0.01) << "Beta(" << a << ") mean";
    EXPECT_NEAR(v, 1.0 / (4 * (2 * a + 1)), 0.05 / (4 * (2 * a + 1))) << "Beta(" << a << ") variance";
  }
  data::MixOptions both{.mixup_alpha = 0.2, .cutmix_alpha = 1.0, .prob = 0.8, .switch_prob = 0.5, .off_epoch = 3};
  int none = 0, mixup = 0, cutmix = 0;
  for (int64_t i = 0; i < 4000; ++i) {
    const auto d = data::draw_mix(both, 11, 1, i, 32, 24);
    const auto again = data::draw_mix(both, 11, 1, i, 32, 24);
    ASSERT_EQ(static_cast<int>(d.kind), static_cast<int>(again.kind));
    ASSERT_EQ(d.weight_q, again.weight_q);
    ASSERT_EQ(d.y0, again.y0);
    ASSERT_EQ(d.x1, again.x1);
    if (d.kind == data::MixKind::none) {
      ++none;
      EXPECT_EQ(d.weight_q, data::kMixOne);
    } else if (d.kind == data::MixKind::mixup) {
      ++mixup;
    } else {
      ++cutmix;
      ASSERT_TRUE(0 <= d.y0 && d.y0 <= d.y1 && d.y1 <= 32 && 0 <= d.x0 && d.x0 <= d.x1 && d.x1 <= 24);
      const double area = static_cast<double>((d.y1 - d.y0) * (d.x1 - d.x0)) / (32 * 24);
      EXPECT_NEAR(d.lambda(), 1 - area, 1e-6) << "cutmix's lambda is the box's complement";
    }
    EXPECT_EQ(data::draw_mix(both, 11, 3, i, 32, 24).kind, data::MixKind::none) << "mix_off_epoch stops it";
  }
  EXPECT_NEAR(none / 4000.0, 0.2, 0.03);
  EXPECT_NEAR(mixup / 4000.0, 0.4, 0.03);
  EXPECT_NEAR(cutmix / 4000.0, 0.4, 0.03);
  EXPECT_NE(data::draw_mix(both, 11, 1, 5, 32, 24).weight_q + data::draw_mix(both, 11, 1, 6, 32, 24).weight_q +
                data::draw_mix(both, 11, 1, 7, 32, 24).weight_q,
            data::draw_mix(both, 12, 1, 5, 32, 24).weight_q + data::draw_mix(both, 12, 1, 6, 32, 24).weight_q +
                data::draw_mix(both, 12, 1, 7, 32, 24).weight_q)
      << "another seed draws differently";
}

// The loader mixes the same pairs the same way for 1 replica of micro-batch 8 and 2 replicas of 4
// (or 4 with accumulation): the global batch's images and labels are byte-identical.
TEST(Recipes, MixedBatchesAreTheSameForAnyReplicaCountAndAccumulation) {
  auto ds = std::make_shared<data::SyntheticDataset>(Shape{6, 6, 2}, 5, 64);
  auto pool = make_pool({DeviceKind::cpu, 0}, PoolOptions{});
  data::AugmentOptions aug{1, true, {0.5f, 0.5f}, {0.25f, 0.25f}};
  aug.mix = {.mixup_alpha = 0.4, .cutmix_alpha = 1.0, .prob = 0.9};
  auto global = [&](int world, int accum) {
    data::Sharding sh(64, 8 / world / accum, accum, world, 3, true);
    std::vector<char> images, labels;
    for (int r = 0; r < world; ++r) {
      data::ReplicaLoader l(*ds, sh, r, *pool, aug, 9, 2);
      l.begin_epoch(1, 2);
      for (int k = 0; k < accum; ++k) {
        data::Batch b = l.next();
        EXPECT_EQ(b.labels.shape(), (Shape{b.n(), 2}));
        images.insert(images.end(), static_cast<const char*>(b.images.raw()),
                      static_cast<const char*>(b.images.raw()) + b.images.nbytes());
        labels.insert(labels.end(), static_cast<const char*>(b.labels.raw()),
                      static_cast<const char*>(b.labels.raw()) + b.labels.nbytes());
      }
    }
    return std::make_pair(images, labels);
  };
  const auto one = global(1, 1), two = global(2, 1), acc = global(2, 2);
  EXPECT_TRUE(one == two) << "2 replicas mix what 1 does";
  EXPECT_TRUE(one == acc) << "accumulation mixes what 1 does";
  int mixed = 0;
  for (size_t i = 0; i < one.second.size() / 8; ++i) {
    int32_t q;
    std::memcpy(&q, one.second.data() + 8 * i + 4, 4);
    mixed += q != data::kMixOne;
  }
  EXPECT_GT(mixed, 0) << "some pairs are mixed";
}

// An odd micro-batch cannot be paired: the run says so before it starts.
TEST(Recipes, MixingNeedsAnEvenMicroBatch) {
  try {
    train::Trainer t(train::parse_config("", "test",
                                         {"data.dataset=synthetic", "data.synthetic_shape=[8,8,1]", "data.synthetic_size=64",
                                          "model.width=4", "train.global_batch=6", "parallel.devices=cpu:2",
                                          "data.mixup_alpha=0.2", "train.tensorboard=false"}),
                     train::TrainerOptions{.print = false});
    ADD_FAILURE() << "an odd micro-batch was accepted with mixing";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("even train.micro_batch"), std::string::npos) << e.what();
  }
}
