// GPU pools (label gpu): the cudaMalloc upstream, preallocation of a fraction of total memory and
// the OOM error on a device. Skips itself when no CUDA device is present.
#include <gtest/gtest.h>

#include "core/errors.h"
#include "core/pools.h"
#include "core/tensor.h"

using namespace replica;

namespace {
bool have_gpu() { return !cuda_devices().empty(); }
}  // namespace

TEST(GpuPool, PreallocateFractionAndOom) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device present";
  auto info = cuda_devices().at(0);
  PoolOptions o;
  o.mode = AllocatorMode::preallocate;
  o.fraction = 0.25;
  auto pool = make_pool(info.device, o);
  EXPECT_EQ(pool->stats().reserved, static_cast<size_t>(info.total_memory * 0.25) & ~size_t(255));
  Tensor t = Tensor::empty(*pool, {1 << 20}, DType::f32, MemTag::activations);
  std::vector<float> h(1 << 20, 3.f), back(1 << 20);
  copy_tensor(Tensor::wrap(h.data(), {1 << 20}, DType::f32, {DeviceKind::cpu, 0}), t);
  copy_tensor(t, Tensor::wrap(back.data(), {1 << 20}, DType::f32, {DeviceKind::cpu, 0}));
  EXPECT_EQ(back[12345], 3.f);
  EXPECT_THROW(pool->allocate(info.total_memory / 2, MemTag::activations), OutOfMemoryError);
  Tensor u = Tensor::empty(*pool, {1024}, DType::f32, MemTag::activations);  // still usable
  EXPECT_TRUE(u.defined());
}

TEST(GpuPool, PlatformModeReturnsMemory) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device present";
  PoolOptions o;
  o.mode = AllocatorMode::platform;
  auto pool = make_pool(cuda_devices().at(0).device, o);
  void* p = pool->allocate(1 << 20, MemTag::other);
  EXPECT_EQ(pool->stats().reserved, size_t(1) << 20);
  pool->deallocate(p);
  EXPECT_EQ(pool->stats().reserved, 0u);
}
