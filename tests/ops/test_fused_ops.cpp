// Fused CPU kernels against their unfused sequence, bit for bit: batch-norm backward (on the
// batch's statistics, and frozen on running ones) with the ReLU's mask folded into its first pass
// equals relu_backward followed by the plain backward, in f32, f16 and bf16 (dx, dgamma, dbeta,
// and dy as masked in place).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "ops/backend.h"
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

INSTANTIATE_TEST_SUITE_P(Dtypes, FusedOps, ::testing::Values(DType::f32, DType::f16, DType::bf16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
