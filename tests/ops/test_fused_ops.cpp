// Fused CPU kernels against their unfused sequence, bit for bit: batch-norm backward (on the
// batch's statistics, and frozen on running ones) with the ReLU's mask folded into its first pass
// equals relu_backward followed by the plain backward, in f32, f16 and bf16 (dx, dgamma, dbeta,
// and dy as masked in place); batch norm + add + ReLU equals batch norm then add_relu (f32: same
// bits; 16-bit: one rounding instead of two); a convolution's input gradient added into a tensor
// equals computing it and adding. And the fused residual block against the unfused one, whole:
// the same bits in f32 for outputs, every gradient and the running statistics.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "ops/backend.h"
#include "ops/nn/layer.h"
#include "support/layer_harness.h"

using namespace replica;

namespace {

Tensor filled(MemoryPool& pool, Shape s, DType dt, std::mt19937& rng, float lo, float hi) {
  Tensor f = Tensor::empty(pool, s, DType::f32, MemTag::activations);
  replica::testing::fill_random(f, rng, lo, hi);
  if (dt == DType::f32) return f;
  Tensor t = Tensor::empty(pool, s, dt, MemTag::activations);
  convert(f.raw(), DType::f32, t.raw(), dt, static_cast<size_t>(f.numel()));
  return t;
}

Tensor copy_of(MemoryPool& pool, const Tensor& t) {
  Tensor c = Tensor::empty(pool, t.shape(), t.dtype(), MemTag::activations);
  std::memcpy(c.raw(), t.raw(), t.nbytes());
  return c;
}

bool same_bits(const Tensor& a, const Tensor& b) { return a.nbytes() == b.nbytes() && !std::memcmp(a.raw(), b.raw(), a.nbytes()); }

class FusedOps : public ::testing::TestWithParam<DType> {};

// Runs batch-norm backward (frozen or not) once with the ReLU mask fused and once after a
// separate relu_backward, on the same inputs, and checks every output for the same bits.
void check_fused_relu(bool frozen, DType dt) {
  auto pool = replica::testing::test_pool();
  auto& be = ops::backend_for(pool->device());
  std::mt19937 rng(5);
  // 3 x 5 x 7 x 24: rows are not a multiple of the kernel's row block, channels not of 16.
  const Shape sh{3, 5, 7, 24};
  const int64_t C = 24;
  Tensor x = filled(*pool, sh, dt, rng, -1.f, 1.f), y = filled(*pool, sh, dt, rng, -1.f, 1.f);
  Tensor gamma = filled(*pool, {C}, dt, rng, 0.5f, 1.5f);
  Tensor mean = filled(*pool, {C}, DType::f32, rng, -0.2f, 0.2f), inv = filled(*pool, {C}, DType::f32, rng, 0.5f, 2.f);
  Tensor dy_fused = filled(*pool, sh, dt, rng, -1.f, 1.f), dy_plain = copy_of(*pool, dy_fused);
  Tensor dg0 = filled(*pool, {C}, DType::f32, rng, -1.f, 1.f), db0 = filled(*pool, {C}, DType::f32, rng, -1.f, 1.f);
  Tensor dg[2] = {copy_of(*pool, dg0), copy_of(*pool, dg0)}, db[2] = {copy_of(*pool, db0), copy_of(*pool, db0)};
  Tensor dx[2] = {Tensor::empty(*pool, sh, dt, MemTag::activations), Tensor::empty(*pool, sh, dt, MemTag::activations)};
  auto backward = [&](const Tensor& dy, int i, const Tensor& relu_y) {
    if (frozen) be.batchnorm_backward_frozen(dy, x, gamma, mean, inv, dx[i], dg[i], db[i], relu_y);
    else be.batchnorm_backward(dy, x, gamma, mean, inv, dx[i], dg[i], db[i], nullptr, relu_y);
  };
  backward(dy_fused, 0, y);
  be.relu_backward(y, dy_plain, dy_plain);
  backward(dy_plain, 1, Tensor());

  EXPECT_TRUE(same_bits(dy_fused, dy_plain)) << "dy masked in place";
  EXPECT_TRUE(same_bits(dx[0], dx[1])) << "dx";
  EXPECT_TRUE(same_bits(dg[0], dg[1])) << "dgamma";
  EXPECT_TRUE(same_bits(db[0], db[1])) << "dbeta";
  // The mask did something: some of dy is now zero, some is not.
  Tensor f = Tensor::empty(*pool, sh, DType::f32, MemTag::activations);
  convert(dy_fused.raw(), dt, f.raw(), DType::f32, static_cast<size_t>(f.numel()));
  int64_t zeros = 0;
  for (int64_t i = 0; i < f.numel(); ++i) zeros += f.data<float>()[i] == 0.f;
  EXPECT_GT(zeros, f.numel() / 4);
  EXPECT_LT(zeros, 3 * f.numel() / 4);
}

TEST_P(FusedOps, BatchNormBackwardWithTheReluMaskEqualsMaskThenBackward) { check_fused_relu(false, GetParam()); }

TEST_P(FusedOps, FrozenBatchNormBackwardWithTheReluMaskEqualsMaskThenBackward) { check_fused_relu(true, GetParam()); }

std::vector<float> floats_of(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  convert(t.raw(), t.dtype(), v.data(), DType::f32, v.size());
  return v;
}

// Batch norm + add + ReLU (training statistics and eval) against batch norm, then add_relu.
TEST_P(FusedOps, BatchNormAddReluEqualsBatchNormThenAddRelu) {
  const DType dt = GetParam();
  auto pool = replica::testing::test_pool();
  auto& be = ops::backend_for(pool->device());
  std::mt19937 rng(9);
  const Shape sh{3, 5, 7, 24};
  const int64_t C = 24;
  Tensor x = filled(*pool, sh, dt, rng, -2.f, 3.f), res = filled(*pool, sh, dt, rng, -2.f, 2.f);
  Tensor gamma = filled(*pool, {C}, dt, rng, 0.5f, 1.5f), beta = filled(*pool, {C}, dt, rng, -0.5f, 0.5f);
  Tensor rm0 = filled(*pool, {C}, DType::f32, rng, -0.2f, 0.2f), rv0 = filled(*pool, {C}, DType::f32, rng, 0.5f, 2.f);
  for (bool train : {true, false}) {
    Tensor y[2], rm[2], rv[2], mean[2], inv[2];
    for (int i = 0; i < 2; ++i) {
      y[i] = Tensor::empty(*pool, sh, dt, MemTag::activations);
      rm[i] = copy_of(*pool, rm0), rv[i] = copy_of(*pool, rv0);
      mean[i] = Tensor::empty(*pool, {C}, DType::f32, MemTag::activations);
      inv[i] = Tensor::empty(*pool, {C}, DType::f32, MemTag::activations);
      const Tensor fused_res = i == 0 ? res : Tensor();
      if (train)
        be.batchnorm_forward_train(x, gamma, beta, y[i], mean[i], inv[i], rm[i], rv[i], 0.1f, 1e-5f, nullptr,
                                   fused_res, i == 0);
      else
        be.batchnorm_forward_eval(x, gamma, beta, y[i], rm[i], rv[i], 1e-5f, fused_res, i == 0);
    }
    be.add_relu(y[1], res, y[1]);
    const char* mode = train ? "training" : "eval";
    if (dt == DType::f32) {
      EXPECT_TRUE(same_bits(y[0], y[1])) << mode;
    } else {  // the fused sum is rounded once; the unfused one twice: at most a rounding apart
      const auto a = floats_of(y[0]), b = floats_of(y[1]);
      const double ulp = dt == DType::f16 ? 1.0 / 1024 : 1.0 / 128;
      for (size_t i = 0; i < a.size(); ++i)
        ASSERT_LE(std::abs(a[i] - b[i]), 2 * ulp * std::max(1.f, std::abs(b[i]))) << mode << " element " << i;
    }
    if (train) {
      EXPECT_TRUE(same_bits(rm[0], rm[1]) && same_bits(rv[0], rv[1])) << "running statistics";
      EXPECT_TRUE(same_bits(mean[0], mean[1]) && same_bits(inv[0], inv[1])) << "saved statistics";
    }
    int64_t zeros = 0;
    for (float v : floats_of(y[0])) zeros += v == 0.f;
    EXPECT_GT(zeros, 0) << "the ReLU clipped something";
  }
}

// conv2d_backward_data with accumulate: dx += the input gradient, the same bits as computing it and
// adding with axpy (what an unfused residual block does), for the kernels' every path (Winograd 3x3,
// direct, GEMM with im2col, 1x1 without).
TEST_P(FusedOps, ConvolutionInputGradientAddedEqualsComputedThenAdded) {
  const DType dt = GetParam();
  auto pool = replica::testing::test_pool();
  auto& be = ops::backend_for(pool->device());
  std::mt19937 rng(13);
  for (auto [C, K, R, stride] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{8, 16, 3, 1}, {16, 16, 3, 2},
                                 {24, 8, 1, 1}, {5, 7, 3, 1}}) {
    const auto g = ops::ConvGeom::make({2, 9, 9, C}, K, R, R, stride, R / 2, "test");
    Tensor w = filled(*pool, {K, R, R, C}, dt, rng, -0.3f, 0.3f), dy = filled(*pool, {2, g.P, g.Q, K}, dt, rng, -1.f, 1.f);
    Tensor acc0 = filled(*pool, {2, 9, 9, C}, dt, rng, -1.f, 1.f);
    Tensor fused = copy_of(*pool, acc0), plain = copy_of(*pool, acc0), dx = Tensor::empty(*pool, acc0.shape(), dt, MemTag::activations);
    be.conv2d_backward_data(dy, w, fused, g, *pool, true);
    be.conv2d_backward_data(dy, w, dx, g, *pool, false);
    be.axpy(1.f, dx, plain);
    EXPECT_TRUE(same_bits(fused, plain)) << "C " << C << " K " << K << " R " << R << " stride " << stride;
    EXPECT_FALSE(same_bits(fused, acc0)) << "something was added";
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FusedOps, ::testing::Values(DType::f32, DType::f16, DType::bf16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// A residual block with and without the fused join (Residual::set_fused_join), from the same
// parameters, input and output gradient: outputs, the input gradient, every parameter gradient and
// the running statistics bit for bit (f32, CPU), for a projection and an identity shortcut, with
// batch statistics, frozen ones, and under gradient checkpointing.
struct BlockRun {
  std::vector<float> y, dx, grads, buffers;
};

std::unique_ptr<nn::Residual> make_block(bool projection) {
  const int64_t cin = projection ? 8 : 16, stride = projection ? 2 : 1;
  auto main = std::make_unique<nn::Sequential>("main");
  main->emplace<nn::Conv2d>("c1", cin, 16, 3, stride, 1);
  main->emplace<nn::BatchNorm2d>("b1", 16, 0.1f, 1e-5f, false, true);
  main->emplace<nn::Conv2d>("c2", 16, 16, 3, 1, 1);
  main->emplace<nn::BatchNorm2d>("b2", 16);
  std::unique_ptr<nn::Sequential> sc;
  if (projection) {
    sc = std::make_unique<nn::Sequential>("sc");
    sc->emplace<nn::Conv2d>("sc.conv", cin, 16, 1, stride, 0);
    sc->emplace<nn::BatchNorm2d>("sc.bn", 16);
  }
  return std::make_unique<nn::Residual>("block", std::move(main), std::move(sc));
}

BlockRun run_block(bool projection, bool fused, bool frozen, bool recompute) {
  auto pool = replica::testing::test_pool();
  auto block = make_block(projection);
  block->set_fused_join(fused);
  block->set_recompute(recompute);
  EXPECT_EQ(block->fused_join() != nullptr, fused);
  replica::testing::LayerHarness h(*block, *pool, 3);
  if (frozen) h.freeze_bn();
  std::mt19937 rng(21);
  const int64_t cin = projection ? 8 : 16;
  Tensor x = Tensor::empty(*pool, {4, 10, 10, cin}, DType::f32, MemTag::activations);
  replica::testing::fill_random(x, rng, -1.f, 1.f);
  BlockRun out;
  for (int pass = 0; pass < 2; ++pass) {  // twice: gradients accumulate, running statistics move on
    nn::Context ctx(*pool, ops::backend_for(pool->device()), true);
    ctx.bn_frozen = frozen;
    Tensor y = block->forward(ctx, x);
    Tensor dy = Tensor::empty(*pool, y.shape(), DType::f32, MemTag::activations);
    replica::testing::fill_random(dy, rng, -1.f, 1.f);
    out.y = floats_of(y);
    Tensor dx = block->backward(ctx, dy);
    EXPECT_EQ(ctx.saved_count(), 0u);
    out.dx = floats_of(dx);
  }
  nn::Context eval(*pool, ops::backend_for(pool->device()), false);
  const auto ye = floats_of(block->forward(eval, x));
  out.y.insert(out.y.end(), ye.begin(), ye.end());
  out.grads = floats_of(h.grads());
  out.buffers = floats_of(h.buffers());
  return out;
}

TEST(FusedResidual, TheFusedJoinGivesTheUnfusedBits) {
  for (bool projection : {true, false})
    for (bool frozen : {false, true})
      for (bool recompute : {false, true}) {
        SCOPED_TRACE(std::string(projection ? "projection" : "identity") + (frozen ? ", frozen BN" : "") +
                     (recompute ? ", recomputed" : ""));
        const BlockRun a = run_block(projection, true, frozen, recompute), b = run_block(projection, false, frozen, recompute);
        EXPECT_EQ(a.y, b.y) << "outputs (training, then eval)";
        EXPECT_EQ(a.dx, b.dx) << "input gradient";
        EXPECT_EQ(a.grads, b.grads) << "parameter gradients";
        EXPECT_EQ(a.buffers, b.buffers) << "running statistics";
        int64_t zeros = 0;
        for (float v : a.y) zeros += v == 0.f;
        EXPECT_GT(zeros, 0) << "the join's ReLU clipped something";
      }
}

}  // namespace
