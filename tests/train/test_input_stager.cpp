// InputStager: batches come out in order with their contents, on the CPU (pass-through) and on
// a GPU (double-buffered copies on the copy stream; that case skips itself without a device).
#include <gtest/gtest.h>

#include "core/pools.h"
#include "core/stream.h"
#include "train/input_stager.h"

using namespace replica;

namespace {

data::Batch make_batch(MemoryPool& host, int64_t n, float v) {
  data::Batch b;
  b.images = Tensor::empty(host, {n, 2, 2, 1}, DType::f32, MemTag::data);
  b.labels = Tensor::empty(host, {n}, DType::i32, MemTag::data);
  for (int64_t i = 0; i < b.images.numel(); ++i) b.images.data<float>()[i] = v + static_cast<float>(i);
  for (int64_t i = 0; i < n; ++i) b.labels.data<int32_t>()[i] = static_cast<int32_t>(v) + static_cast<int32_t>(i);
  return b;
}

// Pushes batch k + 1 before using batch k, as the trainer does on a GPU, for 7 batches; every
// batch handed out must live on `where` (the replica's device).
void run_in_order(train::InputStager& st, MemoryPool& host, bool ahead, DeviceKind where) {
  st.push(make_batch(host, 3, 0.f));
  for (int k = 0; k < 7; ++k) {
    if (st.empty()) st.push(make_batch(host, 3, 100.f * k));
    auto [x, y] = st.front();
    EXPECT_EQ(x.device().kind, where) << "batch " << k;
    EXPECT_EQ(y.device().kind, where) << "batch " << k;
    if (ahead && k + 1 < 7) {
      st.push(make_batch(host, 3, 100.f * (k + 1)));
      ASSERT_TRUE(st.full());
      EXPECT_THROW(st.push(make_batch(host, 3, 0.f)), Error) << "two batches at most";
    }
    auto xi = host_floats(x);
    ASSERT_EQ(xi.size(), 12u);
    EXPECT_EQ(xi[0], 100.f * k) << "batch " << k;
    EXPECT_EQ(xi[11], 100.f * k + 11.f);
    std::string lb = tensor_to_bytes(y);
    int32_t l2;
    std::memcpy(&l2, lb.data() + 8, 4);
    EXPECT_EQ(l2, 100 * k + 2);
    st.pop();
    if (!ahead) {
      EXPECT_TRUE(st.empty());
    }
  }
}

}  // namespace

TEST(InputStager, CpuPassesBatchesThrough) {
  auto pool = make_pool({DeviceKind::cpu, 0}, PoolOptions{});
  CpuStream compute({DeviceKind::cpu, 0});
  train::InputStager st(*pool, nullptr, &compute);
  auto b = make_batch(*pool, 3, 5.f);
  const void* raw = b.images.raw();
  st.push(std::move(b));
  EXPECT_EQ(st.front().first.raw(), raw) << "no copy on the CPU";
  st.pop();
  EXPECT_THROW(st.front(), Error);
  run_in_order(st, *pool, false, DeviceKind::cpu);
  run_in_order(st, *pool, true, DeviceKind::cpu);
  EXPECT_TRUE(st.empty()) << "drained";
}

TEST(InputStager, GpuCopiesAheadOnTheCopyStream) {
  if (cuda_devices().empty()) GTEST_SKIP() << "no CUDA device present";
  const Device d{DeviceKind::cuda, 0};
  PoolOptions o;
  o.mode = AllocatorMode::growth;
  auto pool = make_pool(d, o);
  auto host = make_staging_pool(d);
  auto compute = make_stream(d), copy = make_stream(d);
  set_current_stream(compute.get());
  {
    train::InputStager st(*pool, copy.get(), compute.get());
    run_in_order(st, *host, true, DeviceKind::cuda);
    EXPECT_TRUE(st.empty()) << "drained";
  }
  set_current_stream(nullptr);
}
