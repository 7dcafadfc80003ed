// Finite-difference gradient checks for every CPU op (through its layer) and a residual block.
// Central differences with eps 1e-2 on f32 kernels, losses summed in double; tolerance 2e-2
// relative (f32 rounding of the forward pass divided by 2*eps bounds the numeric error).
#include <gtest/gtest.h>

#include "ops/models/resnet.h"
#include "support/layer_harness.h"

using namespace replica;
using replica::testing::fill_random;
using replica::testing::LayerHarness;

namespace {
constexpr double kTol = 2e-2;

Tensor random_input(MemoryPool& pool, Shape s, uint32_t seed = 3) {
  Tensor x = Tensor::empty(pool, s, DType::f32, MemTag::activations);
  std::mt19937 rng(seed);
  fill_random(x, rng);
  return x;
}
}  // namespace

struct ConvCase {
  int64_t cin, cout, k, stride, pad, h, w;
};

class ConvGrad : public ::testing::TestWithParam<ConvCase> {};

TEST_P(ConvGrad, MatchesFiniteDifferences) {
  auto c = GetParam();
  auto pool = replica::testing::test_pool();
  nn::Conv2d conv("conv", c.cin, c.cout, c.k, c.stride, c.pad);
  LayerHarness h(conv, *pool);
  h.check(random_input(*pool, {2, c.h, c.w, c.cin}), kTol);
}

INSTANTIATE_TEST_SUITE_P(Shapes, ConvGrad,
                         ::testing::Values(ConvCase{3, 4, 3, 1, 1, 5, 6},   // 3x3 same
                                           ConvCase{2, 3, 3, 2, 1, 7, 7},   // strided, odd size
                                           ConvCase{4, 5, 1, 1, 0, 4, 4},   // 1x1 fast path
                                           ConvCase{4, 6, 1, 2, 0, 6, 5},   // 1x1 strided (shortcut)
                                           ConvCase{1, 2, 7, 2, 3, 9, 9},   // ImageNet stem
                                           ConvCase{2, 2, 2, 1, 0, 4, 4},   // even kernel, no pad
                                           ConvCase{3, 2, 5, 3, 2, 8, 7}),  // 5x5 stride 3
                         [](const ::testing::TestParamInfo<ConvCase>& i) {
                           auto c = i.param;
                           return "k" + std::to_string(c.k) + "s" + std::to_string(c.stride) + "p" +
                                  std::to_string(c.pad) + "c" + std::to_string(c.cin) + "to" +
                                  std::to_string(c.cout) + "_" + std::to_string(c.h) + "x" + std::to_string(c.w);
                         });

TEST(OpGrad, BatchNormTrain) {
  auto pool = replica::testing::test_pool();
  nn::BatchNorm2d bn("bn", 3);
  LayerHarness h(bn, *pool);
  h.check(random_input(*pool, {4, 3, 3, 3}), kTol);
}

TEST(OpGrad, BatchNormWithFusedRelu) {
  auto pool = replica::testing::test_pool();
  nn::BatchNorm2d bn("bn_relu", 3, 0.1f, 1e-5f, false, /*relu=*/true);
  LayerHarness h(bn, *pool);
  h.check(random_input(*pool, {4, 3, 3, 3}), kTol);
}

TEST(OpGrad, FrozenBatchNormWithAndWithoutRelu) {
  // model.freeze_bn: an affine map by the running statistics (set away from 0 and 1 here, so a
  // missing square root or a swapped mean shows in the gradients as in the output).
  for (bool relu : {false, true}) {
    auto pool = replica::testing::test_pool();
    nn::BatchNorm2d bn(relu ? "bn_frozen_relu" : "bn_frozen", 3, 0.1f, 1e-5f, false, relu);
    LayerHarness h(bn, *pool);
    h.freeze_bn();
    // eps 1e-3: with the ReLU, a step of 1e-2 in a bias moves outputs across the kink at 0.
    h.check(random_input(*pool, {4, 3, 3, 3}), kTol, 40, 1e-3f);
  }
}

TEST(OpGrad, ReluMaxPoolAvgPoolLinear) {
  auto pool = replica::testing::test_pool();
  nn::ReLU relu("relu");
  LayerHarness(relu, *pool).check(random_input(*pool, {2, 3, 3, 4}), kTol);
  nn::MaxPool2d mp("maxpool", 3, 2, 1);
  LayerHarness(mp, *pool).check(random_input(*pool, {2, 5, 5, 3}), kTol, 40, 1e-3f);
  nn::GlobalAvgPool gap("gap");
  LayerHarness(gap, *pool).check(random_input(*pool, {2, 3, 4, 5}), kTol);
  nn::Linear fc("fc", 6, 4);
  LayerHarness(fc, *pool).check(random_input(*pool, {3, 6}), kTol);
}

TEST(OpGrad, ResidualBlockWithProjection) {
  auto pool = replica::testing::test_pool();
  auto main = std::make_unique<nn::Sequential>("main");
  main->emplace<nn::Conv2d>("c1", 3, 4, 3, 2, 1);
  main->emplace<nn::BatchNorm2d>("b1", 4);
  main->emplace<nn::ReLU>("r1", true);
  main->emplace<nn::Conv2d>("c2", 4, 4, 3, 1, 1);
  main->emplace<nn::BatchNorm2d>("b2", 4);
  auto sc = std::make_unique<nn::Sequential>("sc");
  sc->emplace<nn::Conv2d>("sc.conv", 3, 4, 1, 2, 0);
  sc->emplace<nn::BatchNorm2d>("sc.bn", 4);
  nn::Residual block("block", std::move(main), std::move(sc));
  ASSERT_NE(block.fused_join(), nullptr) << "batch norm + add + ReLU fused";
  LayerHarness h(block, *pool);
  // eps 1e-3: the block ends in a ReLU, and a wider step would straddle its kink
  h.check(random_input(*pool, {3, 6, 6, 3}), kTol, 40, 1e-3f);
  block.set_fused_join(false);  // the unfused join (add_relu, relu_backward, axpy) too
  LayerHarness(block, *pool).check(random_input(*pool, {3, 6, 6, 3}), kTol, 40, 1e-3f);
}

TEST(OpGrad, ResidualBlockWhoseMainPathEndsInAReluIsNotFused) {
  auto pool = replica::testing::test_pool();
  auto main = std::make_unique<nn::Sequential>("main");
  main->emplace<nn::Conv2d>("c1", 3, 3, 3, 1, 1);
  main->emplace<nn::BatchNorm2d>("b1", 3, 0.1f, 1e-5f, false, true);  // a ReLU of its own
  nn::Residual block("block", std::move(main), nullptr);
  EXPECT_EQ(block.fused_join(), nullptr);
  LayerHarness(block, *pool).check(random_input(*pool, {2, 4, 4, 3}), kTol, 40, 1e-3f);
}

TEST(OpGrad, IdentityResidualBlock) {
  auto pool = replica::testing::test_pool();
  auto main = std::make_unique<nn::Sequential>("main");
  main->emplace<nn::Conv2d>("c1", 3, 3, 3, 1, 1);
  main->emplace<nn::BatchNorm2d>("b1", 3);
  nn::Residual block("block", std::move(main), nullptr);
  LayerHarness h(block, *pool);
  h.check(random_input(*pool, {2, 4, 4, 3}), kTol, 40, 1e-3f);
}

TEST(OpGrad, SoftmaxCrossEntropy) {
  auto pool = replica::testing::test_pool();
  auto& be = ops::backend_for({DeviceKind::cpu, 0});
  Tensor z = random_input(*pool, {4, 5});
  Tensor lab = Tensor::empty(*pool, {4}, DType::i32, MemTag::other);
  for (int i = 0; i < 4; ++i) lab.data<int32_t>()[i] = (i * 3) % 5;
  Tensor p = Tensor::empty(*pool, {4, 5}, DType::f32, MemTag::other);
  Tensor dz = Tensor::empty(*pool, {4, 5}, DType::f32, MemTag::other);
  auto r = be.softmax_xent_forward(z, lab, p);
  be.softmax_xent_backward(p, lab, 0.25f, dz, 0.f);  // mean over 4
  for (int i = 0; i < 20; ++i) {
    float* v = z.data<float>() + i;
    float old = *v;
    *v = old + 1e-2f;
    double lp = be.softmax_xent_forward(z, lab, p).loss_sum / 4;
    *v = old - 1e-2f;
    double lm = be.softmax_xent_forward(z, lab, p).loss_sum / 4;
    *v = old;
    EXPECT_NEAR(dz.data<float>()[i], (lp - lm) / 2e-2, 1e-3);
  }
  EXPECT_GT(r.loss_sum, 0);
  lab.data<int32_t>()[2] = 9;
  EXPECT_THROW(be.softmax_xent_forward(z, lab, p), ShapeError);
}

TEST(OpGrad, SmallResNetEndToEnd) {
  auto pool = replica::testing::test_pool();
  models::ResNetConfig cfg;
  cfg.arch = "resnet20";
  cfg.base_width = 2;
  cfg.height = cfg.width = 8;
  cfg.num_classes = 3;
  auto model = models::make_resnet(cfg);
  LayerHarness h(model->root(), *pool);
  // 20 layers of ReLU: wider steps straddle kinks (mismatches fall 114 -> 5 -> 0 as eps goes
  // 3e-3 -> 3e-4 -> 1e-4), so this whole-network check uses a small step.
  h.check(random_input(*pool, {4, 8, 8, 1}), kTol, 10, 1e-4f);
}
