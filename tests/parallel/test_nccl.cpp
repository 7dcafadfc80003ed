// NCCL communicator on the visible GPUs (label gpu; skips without a device): every collective on
// device buffers, checked on the host, the same assertions as the host communicator's tests.
#include <gtest/gtest.h>

#include "core/tensor.h"
#include "parallel/nccl/nccl_communicator.h"
#include "parallel/replica_group.h"

using namespace replica;
using namespace replica::parallel;

// Every test needs a GPU and NCCL, and skips cleanly without them.
class Nccl : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_devices().empty()) GTEST_SKIP() << "no CUDA device present";
    if (!nccl_compiled()) GTEST_SKIP() << "built without NCCL";
  }
};

TEST_F(Nccl, CollectivesOnDeviceBuffers) {
  GroupOptions o;
  o.cuda_pool.mode = AllocatorMode::growth;
  o.cuda_pool.bytes = size_t(256) << 20;
  o.solo_single_gpu = false;  // NCCL even on one GPU
  ReplicaGroup group(parse_devices("cuda"), o);
  const int world = group.world();
  const Device cpu{DeviceKind::cpu, 0};
  for (size_t n : {size_t(1), size_t(7), size_t(1000003)}) {
    group.run([&](Replica& rep) {
      const int r = rep.rank();
      Tensor d = Tensor::empty(rep.pool(), {static_cast<int64_t>(n)}, DType::f32, MemTag::comm);
      std::vector<float> h(n);
      auto up = [&] {
        copy_tensor(Tensor::wrap(h.data(), d.shape(), DType::f32, cpu), d, &rep.stream());
        rep.stream().synchronize();
      };
      auto down = [&] {
        copy_tensor(d, Tensor::wrap(h.data(), d.shape(), DType::f32, cpu), &rep.stream());
        rep.stream().synchronize();
      };
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
        for (size_t i = 0; i < n; ++i) h[i] = static_cast<float>(i % 5 + r);
        up();
        rep.comm().all_reduce(d.raw(), n, DType::f32, op);
        down();
        double want = op == ReduceOp::max ? (n - 1) % 5 + world - 1
                                          : world * double((n - 1) % 5) + world * (world - 1) / 2.0;
        if (op == ReduceOp::avg) want /= world;
        EXPECT_NEAR(h[n - 1], want, 1e-4) << reduce_op_name(op);
      }
      for (auto& v : h) v = static_cast<float>(r);
      up();
      rep.comm().broadcast(d.raw(), n, DType::f32, world - 1);
      down();
      EXPECT_EQ(h[0], static_cast<float>(world - 1));
      Tensor all = Tensor::empty(rep.pool(), {static_cast<int64_t>(n) * world}, DType::f32, MemTag::comm);
      rep.comm().all_gather(d.raw(), all.raw(), n, DType::f32);
      rep.comm().barrier();
    });
  }
}

namespace {
std::vector<float> down(Replica&, const Tensor& t) { return host_floats(t); }
Tensor up(Replica& rep, const std::vector<float>& v, DType dt) {
  std::vector<char> b(v.size() * dtype_size(dt));
  convert(v.data(), DType::f32, b.data(), dt, v.size());
  Tensor t = Tensor::empty(rep.pool(), {static_cast<int64_t>(v.size())}, dt, MemTag::comm);
  tensor_from_bytes(t, b.data(), b.size());
  return t;
}
GroupOptions small_pools() {
  GroupOptions o;
  o.cuda_pool.mode = AllocatorMode::growth;
  o.solo_single_gpu = false;  // NCCL even on one GPU
  return o;
}
}  // namespace

// The host communicator's dtype and layout assertions, on NCCL: f16/bf16 sums (small integers,
// exact in 16 bits), all-gather and reduce-scatter contents, odd sizes.
TEST_F(Nccl, SixteenBitReductionsAndGatherScatterContents) {
  ReplicaGroup group(parse_devices("cuda"), small_pools());
  const int world = group.world();
  group.run([&](Replica& rep) {
    const int r = rep.rank();
    for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
      const size_t n = 1001;
      std::vector<float> v(n);
      for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>((i % 7) + r);
      Tensor t = up(rep, v, dt);
      rep.comm().all_reduce(t.raw(), n, dt, ReduceOp::sum);
      auto h = down(rep, t);
      for (size_t i : {size_t(0), size_t(500), n - 1})
        EXPECT_EQ(h[i], static_cast<float>(world * (i % 7) + world * (world - 1) / 2)) << dtype_name(dt) << " " << i;
    }
    const size_t n = 13;
    std::vector<float> mine(n, static_cast<float>(r + 1));
    Tensor s = up(rep, mine, DType::f32);
    Tensor all = Tensor::empty(rep.pool(), {static_cast<int64_t>(n) * world}, DType::f32, MemTag::comm);
    rep.comm().all_gather(s.raw(), all.raw(), n, DType::f32);
    auto g = down(rep, all);
    for (int q = 0; q < world; ++q) EXPECT_EQ(g[q * n + n - 1], static_cast<float>(q + 1)) << "block of rank " << q;
    std::vector<float> blocks(n * world);
    for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = static_cast<float>(i / n);  // block q holds q
    Tensor b = up(rep, blocks, DType::f32), out = Tensor::empty(rep.pool(), {static_cast<int64_t>(n)}, DType::f32, MemTag::comm);
    rep.comm().reduce_scatter(b.raw(), out.raw(), n, DType::f32, ReduceOp::sum);
    EXPECT_EQ(down(rep, out)[n - 1], static_cast<float>(world * r)) << "rank r receives the sum of block r";
  });
}

// What the trainer does with host numbers on GPU replicas (losses, stop votes, checkpoints):
// psum and all_gather on host memory stage through the device; on device memory they do not.
TEST_F(Nccl, ReplicaHelpersTakeHostAndDevicePointers) {
  ReplicaGroup group(parse_devices("cuda"), small_pools());
  const int world = group.world();
  group.run([&](Replica& rep) {
    const int r = rep.rank();
    float h[3] = {1.f, static_cast<float>(r), 2.f};
    rep.psum(h, 3);
    EXPECT_EQ(h[0], static_cast<float>(world));
    EXPECT_EQ(h[1], static_cast<float>(world * (world - 1) / 2));
    rep.pmean(h, 3);
    EXPECT_EQ(h[2], static_cast<float>(2 * world));
    auto g = rep.all_gather(h, 1);
    ASSERT_EQ(g.size(), static_cast<size_t>(world));
    Tensor d = up(rep, {static_cast<float>(r)}, DType::f32);
    rep.psum(d.data<float>(), 1);
    EXPECT_EQ(down(rep, d)[0], static_cast<float>(world * (world - 1) / 2));
    auto gd = rep.all_gather(up(rep, {static_cast<float>(r + 10)}, DType::f32).data<float>(), 1);
    for (int q = 0; q < world; ++q) EXPECT_EQ(gd[q], static_cast<float>(q + 10));
  });
}

// Failures: an aborted communicator refuses further collectives with an error naming the rank;
// with two or more GPUs, a rank that never joins a collective makes the others time out (and
// abort) instead of hanging.
TEST_F(Nccl, AbortAndTimeOutNameTheRank) {
  {
    ReplicaGroup group(parse_devices("cuda"), small_pools());
    group.run([&](Replica& rep) {
      rep.comm().abort("test");
      Tensor t = up(rep, {1.f}, DType::f32);
      try {
        rep.comm().all_reduce(t.raw(), 1, DType::f32, ReduceOp::sum);
        ADD_FAILURE() << "a collective on an aborted communicator returned";
      } catch (const CommError& e) {
        EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(rep.rank())), std::string::npos) << e.what();
      }
    });
  }
  if (cuda_devices().size() < 2) GTEST_SKIP() << "the time-out case needs two GPUs";
  GroupOptions o = small_pools();
  o.comm_timeout = std::chrono::seconds(3);
  ReplicaGroup group(parse_devices("cuda"), o);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    group.run([&](Replica& rep) {
      if (rep.rank() == 0) return;  // never joins
      Tensor t = up(rep, {1.f}, DType::f32);
      rep.comm().all_reduce(t.raw(), 1, DType::f32, ReduceOp::sum);
    });
    ADD_FAILURE() << "the collective without rank 0 completed";
  } catch (const ReplicaError& e) {
    EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30)) << "nothing hangs";
}
