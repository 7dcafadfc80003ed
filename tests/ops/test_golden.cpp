// Golden test against PyTorch (tests/reference/make_reference.py): the anchor ResNet-20 with the
// same weights on the same 8 Fashion-MNIST images must give the same logits, loss, gradients,
// batch-norm running statistics, eval-mode logits and losses over 3 SGD steps.
#include <gtest/gtest.h>


#include <cmath>
#include <cstdio>
#include <string>

#include "ops/cpu/direct_conv.h"
#include "ops/models/resnet.h"
#include "optim/optimizer.h"
#include "support/compare.h"
#include "support/fixture.h"
#include "support/layer_harness.h"

using namespace replica;

namespace {

const std::string kFixture = std::string(REPLICA_SOURCE_DIR) + "/tests/fixtures/resnet20_golden.bin";

// max |a - b| / max(max |b|, floor), a per-tensor error relative to its scale; infinite when a value is non-finite on one side only.
double rel_err(const float* a, const std::vector<float>& b, double floor = 1e-3) {
  return replica::testing::rel_diff(a, b.data(), b.size(), floor);
}

struct Golden : ::testing::Test {
  void SetUp() override {
    fx = replica::testing::load_fixture(kFixture, &order);
    pool = replica::testing::test_pool();
    model = models::make_resnet({});
    model->materialize(*pool, 0);
    // PyTorch's named_parameters() order is the registration order of replica's layers.
    size_t i = 0;
    for (auto& name : order) {
      if (name.rfind("param.", 0) != 0) continue;
      auto& slot = model->registry().params().at(i++);
      auto& t = fx.at(name);
      ASSERT_EQ(static_cast<int64_t>(t.data.size()), slot.shape.numel()) << name << " vs " << slot.name;
      std::copy(t.data.begin(), t.data.end(), slot.value->data<float>());
      names.push_back(name.substr(6));
    }
    ASSERT_EQ(i, model->registry().params().size());
    auto& in = fx.at("input");
    x = Tensor::empty(*pool, {8, 28, 28, 1}, DType::f32, MemTag::activations);
    std::copy(in.data.begin(), in.data.end(), x.data<float>());
    labels = Tensor::empty(*pool, {8}, DType::i32, MemTag::activations);
    for (int k = 0; k < 8; ++k) labels.data<int32_t>()[k] = static_cast<int32_t>(fx.at("labels").data[k]);
  }

  // One training-mode forward + backward of the mean cross-entropy; returns the loss.
  double step(Tensor* logits_out = nullptr) {
    auto& be = ops::backend_for(pool->device());
    nn::Context ctx(*pool, be, true);
    Tensor logits = model->forward(ctx, x);
    Tensor probs = ctx.alloc(logits.shape());
    auto r = be.softmax_xent_forward(logits, labels, probs);
    Tensor d = ctx.alloc(logits.shape());
    be.softmax_xent_backward(probs, labels, 1.f / 8, d, 0.f);
    model->backward(ctx, d);
    if (logits_out) *logits_out = logits;
    return r.loss_sum / 8;
  }

  std::map<std::string, replica::testing::FixtureTensor> fx;
  std::vector<std::string> order, names;
  std::unique_ptr<MemoryPool> pool;
  std::unique_ptr<nn::Model> model;
  Tensor x, labels;
};

}  // namespace

TEST_F(Golden, ForwardBackwardMatchPyTorch) {
  model->zero_grad();
  Tensor logits;
  double loss = step(&logits);
  EXPECT_LT(rel_err(logits.data<float>(), fx.at("logits").data), 1e-4);
  EXPECT_NEAR(loss, fx.at("loss").data[0], 1e-5);
  // Gradients: 2e-4 of each tensor's largest entry (f32 sums in another order than oneDNN's).
  for (size_t i = 0; i < names.size(); ++i) {
    auto& slot = model->registry().params()[i];
    EXPECT_LT(rel_err(slot.grad->data<float>(), fx.at("grad." + names[i]).data), 2e-4)
        << "gradient of " << names[i] << " (" << slot.name << ")";
  }
  // Running statistics after one pass: the registry's buffers are in PyTorch's order too.
  size_t b = 0;
  for (auto& name : order) {
    if (name.rfind("buffer.", 0) != 0) continue;
    auto& slot = model->registry().buffers().at(b++);
    EXPECT_LT(rel_err(slot.value->data<float>(), fx.at(name).data), 1e-5) << name << " vs " << slot.name;
  }
  EXPECT_EQ(b, model->registry().buffers().size());
}

TEST_F(Golden, EvalModeMatchesPyTorchWithTheRecordedStatistics) {
  // The training pass moves the running statistics off (0, 1); eval mode then normalises by them
  // (PyTorch's model.eval()), so a mistake there (a missing square root, eps outside it, the
  // batch's statistics instead of the running ones) changes these logits.
  model->zero_grad();
  Tensor train_logits;
  step(&train_logits);
  auto& be = ops::backend_for(pool->device());
  nn::Context ctx(*pool, be, /*training=*/false);
  Tensor logits = model->forward(ctx, x);
  const auto& want = fx.at("eval_logits").data;
  ASSERT_EQ(static_cast<size_t>(logits.numel()), want.size());
  EXPECT_LT(rel_err(logits.data<float>(), want), 1e-4);
  EXPECT_GT(rel_err(train_logits.data<float>(), want), 1e-2) << "eval and training logits must differ here";
}

// Run three times: the 3x3 stride-1 layers of 16 to 64 channels through the direct kernels, then
// through Winograd F(2x2, 3x3) and F(4x4, 3x3) (ops/cpu/winograd_kernels.h) where this CPU runs
// it. The parameter is Winograd's output tile (0: off).
class GoldenSgd : public Golden, public ::testing::WithParamInterface<int> {
 protected:
  void TearDown() override {
    ops::direct::set_winograd(winograd_before_);
    ops::direct::set_winograd_tile(tile_before_);
  }
  bool winograd_before_ = ops::direct::winograd_enabled();
  int tile_before_ = ops::direct::set_winograd_tile(0);
};

TEST_P(GoldenSgd, ThreeSgdStepsTrackPyTorchLosses) {
  const int tile = GetParam();
  const bool winograd = tile != 0;
  ops::direct::set_winograd(winograd);
  ops::direct::set_winograd_tile(tile);
  if (winograd && !ops::direct::available()) GTEST_SKIP() << "no AVX2/FMA: Winograd does not run";
  optim::Sgd sgd(model->registry(), model->num_params(), *pool,
                 {.momentum = 0.9f, .nesterov = true, .weight_decay = 5e-4f});
  auto& want = fx.at("sgd_losses").data;
  auto& want64 = fx.at("sgd_losses_f64").data;
  for (int s = 0; s < 4; ++s) {
    model->zero_grad();
    double loss = step();
    // PyTorch's own f32-vs-f64 spread measures how far rounding alone moves the trajectory. The
    // last loss gets 1e-3: after 3 updates a ReLU pre-activation sits within rounding of zero, and
    // replica and PyTorch take different sides of that kink (checked by finite differences: the
    // numeric derivative lies between the two analytic ones). Before it they agree to 1e-7.
    // Winograd rounds differently and may cross that kink one update earlier. Measured on the
    // 2026-12-03 build: the losses before updates 2 and 3 off PyTorch's by 3.8e-6 and 1.2e-4 with
    // the direct kernels, 4.1e-6 and 1.5e-4 with F(2x2) (an earlier build's F(2x2) crossed early:
    // 8e-4 and 3.3e-3), 1.4e-3 and 1.5e-2 with F(4x4), whose rounding is ten times F(2x2)'s
    // (tests/ops/test_conv_kernels.cpp). So the tolerance after the first update is each path's
    // kink; the losses before it, and one step's gradients (ForwardBackwardMatchPyTorch, on the
    // default path: F(4x4) for these layers), must agree on every path to 1e-5 and 2e-4.
    const double kink = tile == 4 ? 2e-2 : winograd ? 5e-3 : 1e-3;
    double tol = std::max(s < (winograd ? 2 : 3) ? 1e-5 : kink, 3.0 * std::abs(want[s] - want64[s]));
    EXPECT_NEAR(loss, want[s], tol) << "loss before update " << s
                                    << (winograd ? " (Winograd F(" + std::to_string(tile) + "x" + std::to_string(tile) + "))"
                                                 : std::string(" (direct kernels)"));
    std::printf("loss before update %d: %.7f (PyTorch %.7f, off by %.1e)\n", s, loss, want[s], std::abs(loss - want[s]));
    if (s < 3) sgd.step(model->params(), model->grads(), 0.02f);
  }
}

INSTANTIATE_TEST_SUITE_P(ConvPath, GoldenSgd, ::testing::Values(0, 2, 4), [](const ::testing::TestParamInfo<int>& i) {
  return i.param ? "WinogradF" + std::to_string(i.param) : std::string("Direct");
});
