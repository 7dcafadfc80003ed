// NCCL communicator on the visible GPUs (label gpu; skips without a device): every collective on
// device buffers, every element checked on the host and compared across ranks, as the host
// communicator's tests do. With one GPU the group has one rank and every reduction is the
// identity: those runs check the plumbing (copies, sizes, dtypes, errors); the reductions
// themselves (sums of different values, gather order, scatter blocks, the time-out) are tested
// only with two or more ranks, and the tests say which checks need them. REPLICA_TEST_CUDA_DEVICES
// names the group's devices (default: every GPU): cuda:0x2 runs two NCCL ranks on one GPU (NCCL
// 2.30+, scripts/gpu-check.sh's peers phase), which exercises all of it on a one-GPU machine.
#include <gtest/gtest.h>

#include <cstdlib>

#include "core/captured_work.h"
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

namespace {
// The devices of every group here: every GPU, or REPLICA_TEST_CUDA_DEVICES (cuda:0x2: two ranks on GPU 0).
std::vector<Device> test_devices() {
  const char* v = std::getenv("REPLICA_TEST_CUDA_DEVICES");
  return parse_devices(v && *v ? v : "cuda");
}
// Counts the elements of `got` that differ from want(i), naming the first in `first`.
template <class F>
int64_t count_wrong(const std::vector<float>& got, F want, size_t* first) {
  int64_t wrong = 0;
  for (size_t i = got.size(); i-- > 0;)
    if (got[i] != static_cast<float>(want(i))) {
      wrong++;
      *first = i;
    }
  return wrong;
}
}  // namespace

TEST_F(Nccl, CollectivesOnDeviceBuffers) {
  GroupOptions o;
  o.cuda_pool.mode = AllocatorMode::growth;
  o.cuda_pool.bytes = size_t(256) << 20;
  o.solo_single_gpu = false;  // NCCL even on one GPU
  ReplicaGroup group(test_devices(), o);
  const int world = group.world();
  if (world < 2) std::printf("one GPU: every reduction below is the identity (two GPUs test the sums)\n");
  const Device cpu{DeviceKind::cpu, 0};
  for (size_t n : {size_t(1), size_t(7), size_t(1000003)}) {
    std::vector<std::vector<float>> after(world);  // each rank's all-reduce sum result
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
        // value(i, q) = i % 5 + q: small integers, exact in f32 for every op.
        for (size_t i = 0; i < n; ++i) h[i] = static_cast<float>(i % 5 + r);
        up();
        rep.comm().all_reduce(d.raw(), n, DType::f32, op);
        down();
        auto want = [&](size_t i) {
          const double base = static_cast<double>(i % 5);
          if (op == ReduceOp::max) return base + world - 1;
          const double sum = world * base + world * (world - 1) / 2.0;
          return op == ReduceOp::avg ? sum / world : sum;
        };
        size_t first = 0;
        const int64_t wrong = count_wrong(h, want, &first);
        EXPECT_EQ(wrong, 0) << reduce_op_name(op) << " n=" << n << ": " << wrong << " elements wrong, first at "
                            << first << " (" << h[first] << ", want " << want(first) << ")";
        if (op == ReduceOp::sum) after[r] = h;
      }
      for (auto& v : h) v = static_cast<float>(r);
      up();
      rep.comm().broadcast(d.raw(), n, DType::f32, world - 1);
      down();
      size_t first = 0;
      EXPECT_EQ(count_wrong(h, [&](size_t) { return world - 1; }, &first), 0) << "broadcast from the last rank, n=" << n;
      // all-gather: block q holds rank q's buffer (value 100 q + i % 3), in rank order.
      for (size_t i = 0; i < n; ++i) h[i] = static_cast<float>(100 * r + i % 3);
      up();
      Tensor all = Tensor::empty(rep.pool(), {static_cast<int64_t>(n) * world}, DType::f32, MemTag::comm);
      rep.comm().all_gather(d.raw(), all.raw(), n, DType::f32);
      const auto g = host_floats(all);
      ASSERT_EQ(g.size(), n * world);
      EXPECT_EQ(count_wrong(g, [&](size_t i) { return 100.0 * static_cast<double>(i / n) + static_cast<double>((i % n) % 3); }, &first), 0)
          << "all-gather n=" << n << ", first wrong at " << first << " (block of rank " << first / n << ")";
      rep.comm().barrier();
    });
    for (int q = 1; q < world; ++q) EXPECT_TRUE(after[q] == after[0]) << "rank " << q << " disagrees with rank 0, n=" << n;
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
  ReplicaGroup group(test_devices(), small_pools());
  const int world = group.world();
  group.run([&](Replica& rep) {
    const int r = rep.rank();
    for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
      const size_t n = 1001;
      std::vector<float> v(n);
      for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>((i % 7) + r);
      Tensor t = up(rep, v, dt);
      rep.comm().all_reduce(t.raw(), n, dt, ReduceOp::sum);
      size_t first = 0;
      EXPECT_EQ(count_wrong(down(rep, t), [&](size_t i) { return world * (i % 7) + world * (world - 1) / 2; }, &first), 0)
          << dtype_name(dt) << ": first wrong at " << first;
    }
    // all-gather at an odd size: block q is rank q's (q + 1) * (1 + i % 2).
    const size_t n = 13;
    std::vector<float> mine(n);
    for (size_t i = 0; i < n; ++i) mine[i] = static_cast<float>((r + 1) * (1 + i % 2));
    Tensor s = up(rep, mine, DType::f32);
    Tensor all = Tensor::empty(rep.pool(), {static_cast<int64_t>(n) * world}, DType::f32, MemTag::comm);
    rep.comm().all_gather(s.raw(), all.raw(), n, DType::f32);
    size_t first = 0;
    EXPECT_EQ(count_wrong(down(rep, all), [&](size_t i) { return (i / n + 1) * (1 + (i % n) % 2); }, &first), 0)
        << "all-gather: first wrong at " << first << " (block of rank " << first / n << ")";
    // reduce-scatter: element j of block q holds q + j on every rank; rank r receives the sum of
    // block r, world * (r + j). Needs two GPUs to tell blocks apart from the identity.
    std::vector<float> blocks(n * world);
    for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = static_cast<float>(i / n + i % n);
    Tensor b = up(rep, blocks, DType::f32), out = Tensor::empty(rep.pool(), {static_cast<int64_t>(n)}, DType::f32, MemTag::comm);
    rep.comm().reduce_scatter(b.raw(), out.raw(), n, DType::f32, ReduceOp::sum);
    EXPECT_EQ(count_wrong(down(rep, out), [&](size_t j) { return world * (r + j); }, &first), 0)
        << "rank " << r << " receives the sum of block " << r << "; first wrong at " << first;
  });
}

// train.cuda_graph with peers captures NCCL's collectives with the step: the communicator's calls
// on its own stream join a capture of the compute stream through the events it records (begin,
// order_before) and become nodes of the graph. On every visible GPU (one: a rank of one, whose
// all-gather is a copy and whose all-reduce the identity; two or more: sums across ranks): an
// all-gather and an all-reduce captured once, after an eager warm-up as the trainer's, replay over
// new inputs with what the eager calls give; Communicator::stream_work after a replay waits for
// it (the step's read polls it in place of the capture's handles).
TEST_F(Nccl, CollectivesCapturedInACudaGraphReplayOverNewInputs) {
  ReplicaGroup group(test_devices(), small_pools());
  const int world = group.world();
  group.run([&](Replica& rep) {
    const int r = rep.rank();
    const size_t n = 1001;
    Tensor send = up(rep, std::vector<float>(n, 0.f), DType::f32);
    Tensor sum = up(rep, std::vector<float>(n, 0.f), DType::f32);
    Tensor all = Tensor::empty(rep.pool(), {static_cast<int64_t>(n) * world}, DType::f32, MemTag::comm);
    rep.comm().all_gather(send.raw(), all.raw(), n, DType::f32);  // NCCL sets itself up eagerly first
    rep.comm().all_reduce(sum.raw(), n, DType::f32, ReduceOp::sum);
    auto graph = capture_work(rep.device(), rep.pool());
    graph->begin(rep.stream());
    rep.comm().all_gather_async(send.raw(), all.raw(), n, DType::f32)->order_before(rep.stream());
    rep.comm().all_reduce_async(sum.raw(), n, DType::f32, ReduceOp::sum)->order_before(rep.stream());
    graph->end();
    for (int replay = 1; replay <= 2; ++replay) {
      std::vector<float> mine(n), add(n);
      for (size_t i = 0; i < n; ++i) {
        mine[i] = static_cast<float>((r + 1) * replay + i % 3);
        add[i] = static_cast<float>(r + replay + i % 5);
      }
      tensor_from_bytes(send, mine.data(), n * sizeof(float));
      tensor_from_bytes(sum, add.data(), n * sizeof(float));
      graph->launch(rep.stream());
      rep.comm().stream_work(rep.stream(), "the replayed collectives")->wait();
      size_t first = 0;
      EXPECT_EQ(count_wrong(down(rep, all), [&](size_t i) { return (i / n + 1) * replay + (i % n) % 3; }, &first), 0)
          << "replay " << replay << ": all-gather, first wrong at " << first;
      EXPECT_EQ(count_wrong(down(rep, sum),
                            [&](size_t i) { return world * (replay + i % 5) + world * (world - 1) / 2; }, &first),
                0)
          << "replay " << replay << ": all-reduce, first wrong at " << first;
    }
    if (r == 0) std::printf("  %d rank(s): the captured graph holds %zu nodes\n", world, graph->nodes());
  });
}

// What the trainer does with host numbers on GPU replicas (losses, stop votes, checkpoints):
// psum and all_gather on host memory stage through the device; on device memory they do not.
TEST_F(Nccl, ReplicaHelpersTakeHostAndDevicePointers) {
  ReplicaGroup group(test_devices(), small_pools());
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
    for (int q = 0; q < world; ++q) EXPECT_EQ(g[q], h[0]) << "every rank's first value after pmean is the same";
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
    ReplicaGroup group(test_devices(), small_pools());
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
  if (test_devices().size() < 2) GTEST_SKIP() << "the time-out case needs two GPUs (or REPLICA_TEST_CUDA_DEVICES=cuda:0x2)";
  GroupOptions o = small_pools();
  o.comm_timeout = std::chrono::seconds(3);
  ReplicaGroup group(test_devices(), o);
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

// The uneven in-place collectives of parallel.shard on device buffers (grouped ncclReduce /
// ncclBroadcast per owner): the owner's range holds the sum of every rank's values, the rest of
// its buffer is unchanged, and all_gather_v gives every rank every owner's range. With one GPU
// the sum is the rank's own value (the plumbing: bounds, offsets, dtypes).
TEST_F(Nccl, UnevenReduceScatterAndAllGatherOnDeviceBuffers) {
  GroupOptions o;
  o.cuda_pool.mode = AllocatorMode::growth;
  o.cuda_pool.bytes = size_t(64) << 20;
  o.solo_single_gpu = false;
  ReplicaGroup group(test_devices(), o);
  const int world = group.world();
  const size_t n = 100003;
  std::vector<size_t> bounds{0};
  for (int r = 1; r < world; ++r) bounds.push_back(n * r / world + (r == 1 ? 17 : 0));
  bounds.push_back(n);
  const Device cpu{DeviceKind::cpu, 0};
  auto value = [](int r, size_t i) { return static_cast<float>((i % 97) + 1000 * (r + 1)); };  // exact sums
  group.run([&](Replica& rep) {
    const int r = rep.rank();
    Tensor d = Tensor::empty(rep.pool(), {static_cast<int64_t>(n)}, DType::f32, MemTag::comm);
    std::vector<float> h(n);
    for (size_t i = 0; i < n; ++i) h[i] = value(r, i);
    const Tensor hw = Tensor::wrap(h.data(), d.shape(), DType::f32, cpu);
    copy_tensor(hw, d, &rep.stream());
    rep.comm().reduce_scatter_v_async(d.raw(), n, DType::f32, ReduceOp::sum, bounds)->order_before(rep.stream());
    copy_tensor(d, hw, &rep.stream());
    rep.stream().synchronize();
    size_t first = 0;
    const int64_t wrong = count_wrong(h, [&](size_t i) {
      if (i < bounds[r] || i >= bounds[r + 1]) return value(r, i);  // not this rank's: untouched
      float s = 0;
      for (int q = 0; q < world; ++q) s += value(q, i);
      return s;
    }, &first);
    EXPECT_EQ(wrong, 0) << "rank " << r << ": first wrong element " << first;
    rep.comm().all_gather_v_async(d.raw(), n, DType::f32, bounds)->order_before(rep.stream());
    copy_tensor(d, hw, &rep.stream());
    rep.stream().synchronize();
    const int64_t wrong2 = count_wrong(h, [&](size_t i) {
      float s = 0;
      for (int q = 0; q < world; ++q) s += value(q, i);
      return s;
    }, &first);
    EXPECT_EQ(wrong2, 0) << "rank " << r << " after all_gather_v: first wrong element " << first;
  });
}
