// Tensor views over pool blocks: sharing, bounds, release to the pool, host copies.
#include <gtest/gtest.h>

#include "core/errors.h"
#include "core/pools.h"
#include "core/tensor.h"

using namespace replica;

TEST(Tensor, ViewsShareTheBlockAndReturnItToThePool) {
  PoolOptions o;
  o.bytes = 16 << 20;
  auto pool = make_pool({DeviceKind::cpu, 0}, o);
  {
    Tensor t = Tensor::zeros(*pool, {2, 4, 4, 3}, DType::f32, MemTag::activations);
    EXPECT_EQ(t.numel(), 96);
    EXPECT_EQ(t.nbytes(), 384u);
    EXPECT_EQ(pool->stats().tags[static_cast<int>(MemTag::activations)].in_use, 512u);
    Tensor v = t.view(48, {1, 4, 4, 3});
    v.data<float>()[0] = 5.f;
    EXPECT_EQ(t.data<float>()[48], 5.f);
    EXPECT_THROW(t.view(90, {1, 4, 4, 3}), ShapeError);
    EXPECT_THROW(t.reshape({5, 5}), ShapeError);
    EXPECT_EQ(t.reshape({96}).shape(), Shape({96}));
    EXPECT_EQ(t.str(), "f32[2,4,4,3]@cpu:0");
    t = Tensor();
    EXPECT_GT(pool->stats().in_use, 0u) << "the view keeps the block alive";
  }
  EXPECT_EQ(pool->stats().in_use, 0u);
}

TEST(Tensor, HostCopy) {
  PoolOptions o;
  auto pool = make_pool({DeviceKind::cpu, 0}, o);
  Tensor a = Tensor::empty(*pool, {10}, DType::f32, MemTag::other);
  Tensor b = Tensor::empty(*pool, {10}, DType::f32, MemTag::other);
  for (int i = 0; i < 10; ++i) a.data<float>()[i] = static_cast<float>(i);
  copy_tensor(a, b);
  EXPECT_EQ(b.data<float>()[9], 9.f);
  Tensor c = Tensor::empty(*pool, {11}, DType::f32, MemTag::other);
  EXPECT_THROW(copy_tensor(a, c), ShapeError);
}

TEST(Tensor, HostRoundTripsAndStagingWorkOnAnyDevice) {
  // The device-agnostic helpers checkpoints, model files and input staging use (on a CPU pool
  // here; the gpu tests run them on a GPU pool).
  PoolOptions o;
  auto pool = make_pool({DeviceKind::cpu, 0}, o);
  auto other = make_pool({DeviceKind::cpu, 0}, o);
  Tensor t = Tensor::zeros(*pool, {4}, DType::f16, MemTag::other);
  EXPECT_EQ(host_floats(t), std::vector<float>(4, 0.f));
  const float v[4] = {1.f, -2.5f, 65504.f, 0.1f};
  std::vector<char> h(8);
  convert(v, DType::f32, h.data(), DType::f16, 4);
  tensor_from_bytes(t, h.data(), h.size());
  EXPECT_EQ(tensor_to_bytes(t), std::string(h.data(), h.size()));
  auto f = host_floats(t);
  EXPECT_EQ(f[2], 65504.f);
  EXPECT_NEAR(f[3], 0.1f, 1e-4);
  EXPECT_THROW(tensor_from_bytes(t, h.data(), 6), ShapeError);
  EXPECT_EQ(to_pool(t, *pool, MemTag::data).raw(), t.raw()) << "already there: no copy";
  Tensor c = to_pool(t, *other, MemTag::data);
  EXPECT_EQ(c.pool(), other.get());
  EXPECT_EQ(c.tag(), MemTag::data);
  EXPECT_EQ(tensor_to_bytes(c), tensor_to_bytes(t));
}

TEST(Shape, RejectsNegativeAndCounts) {
  EXPECT_THROW(Shape({2, -1}), ShapeError);
  EXPECT_EQ(Shape({2, 3, 4}).numel(), 24);
  EXPECT_EQ(Shape({}).numel(), 1);
}
