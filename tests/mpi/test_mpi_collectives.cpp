// Collectives over MPI (label mpi): run under `mpirun -np 2` by tests/mpi/run_mpi_tests.sh, with
// 2 CPU replicas per process, so every collective crosses both the in-process and the MPI level.
// `--fail-rank N` instead makes global rank N throw mid-run (the script checks the job dies fast
// with a message naming it); `--stall-rank N` makes it stop taking part (the others must name it).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <thread>

#include "core/errors.h"
#include "core/memory/shared_host_memory.h"
#include "core/tensor.h"
#include "parallel/mpi/mpi_communicator.h"
#include "parallel/mpi/node_shared_memory.h"
#include "parallel/replica_group.h"

using namespace replica;
using namespace replica::parallel;

namespace {
int g_fail_rank = -1, g_stall_rank = -1;
float value(int rank, size_t i) { return std::sin(0.37f * static_cast<float>(i) + rank) * (rank + 1); }
}  // namespace

TEST(Mpi, EveryCollectiveAtOddSizesAndAllDtypes) {
  if (!launched_by_mpi()) GTEST_SKIP() << "run under mpirun (tests/mpi/run_mpi_tests.sh)";
  // A failed ASSERT returns one replica early and leaves the others waiting in a collective: 20 s
  // of that ends the job with a message instead of ctest's time-out.
  GroupOptions o;
  o.comm_timeout = std::chrono::seconds(20);
  ReplicaGroup group(parse_devices("cpu:2"), o);
  const int world = group.world();
  ASSERT_EQ(world, 2 * group.processes());
  // Every process is on this machine, so the pools take memory the others can map, unless
  // REPLICA_MPI_ZERO_COPY=0 or REPLICA_MPI_SHM=0 (no node all-reduce) says otherwise.
  {
    const char* zc = std::getenv("REPLICA_MPI_ZERO_COPY");
    const char* shm = std::getenv("REPLICA_MPI_SHM");
    const bool want_shared = !(zc && std::string(zc) == "0") && !(shm && std::string(shm) == "0");
    Tensor t = Tensor::empty(group.replica(0).pool(), {1024}, DType::f32, MemTag::grads);
    EXPECT_EQ(find_shared_region(t.data<float>(), 4096, nullptr), want_shared);
  }
  for (size_t n : {size_t(1), size_t(7), size_t(1000003)}) {
    group.run([&](Replica& rep) {
      auto& c = rep.comm();
      const int r = rep.rank();
      // f32 sum / avg / max
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
        std::vector<float> b(n);
        for (size_t i = 0; i < n; ++i) b[i] = value(r, i);
        c.all_reduce(b.data(), n, DType::f32, op);
        for (size_t i = 0; i < n; i += std::max<size_t>(1, n / 53)) {
          double want = op == ReduceOp::max ? -1e30 : 0;
          for (int q = 0; q < world; ++q)
            want = op == ReduceOp::max ? std::max<double>(want, value(q, i)) : want + value(q, i);
          if (op == ReduceOp::avg) want /= world;
          ASSERT_NEAR(b[i], want, 1e-4) << reduce_op_name(op) << " n=" << n << " i=" << i;
        }
      }
      // f32 sum in pool memory: between the processes' leaders in place (their pools are shared
      // under mpirun), bit for bit the result of the copy path above
      {
        Tensor t = Tensor::empty(rep.pool(), {static_cast<int64_t>(n)}, DType::f32, MemTag::grads);
        std::vector<float> b(n);
        for (size_t i = 0; i < n; ++i) b[i] = t.data<float>()[i] = value(r, i);
        c.all_reduce(t.raw(), n, DType::f32, ReduceOp::sum);
        c.all_reduce(b.data(), n, DType::f32, ReduceOp::sum);
        ASSERT_EQ(0, std::memcmp(t.raw(), b.data(), n * sizeof(float))) << "n=" << n;
      }
      // f16 / bf16 sums in pool memory: in place between the leaders, bit for bit what MPI's
      // operator gives for the same values in a vector
      for (DType dt : {DType::f16, DType::bf16}) {
        Tensor t16 = Tensor::empty(rep.pool(), {static_cast<int64_t>(n)}, dt, MemTag::grads);
        std::vector<float> f(n);
        for (size_t i = 0; i < n; ++i) f[i] = value(r, i);
        std::vector<uint16_t> h(n);
        convert(f.data(), DType::f32, h.data(), dt, n);
        std::memcpy(t16.raw(), h.data(), n * sizeof(uint16_t));
        c.all_reduce(t16.raw(), n, dt, ReduceOp::sum);
        c.all_reduce(h.data(), n, dt, ReduceOp::sum);
        ASSERT_EQ(0, std::memcmp(t16.raw(), h.data(), n * sizeof(uint16_t))) << dtype_name(dt) << " n=" << n;
      }
      // f16 / bf16: small integers, exact in 16 bits
      for (DType dt : {DType::f16, DType::bf16}) {
        std::vector<float> f(n, static_cast<float>(r + 1));
        std::vector<uint16_t> h(n);
        convert(f.data(), DType::f32, h.data(), dt, n);
        c.all_reduce(h.data(), n, dt, ReduceOp::sum);
        convert(h.data(), dt, f.data(), DType::f32, n);
        ASSERT_EQ(f[n - 1], static_cast<float>(world * (world + 1) / 2)) << dtype_name(dt);
      }
      // 16-bit arithmetic at every addition, as NCCL (communicator.h): ranks 0..3 hold 2048, 1,
      // 0, 1. In process 0, 2048 + 1 rounds to 2048 (f16 spacing 2); process 1 sums to 1; across
      // processes 2048 + 1 rounds to 2048 again. f32 arithmetic would give 2050.
      if (world == 4) {
        const float v[4] = {2048.f, 1.f, 0.f, 1.f};
        uint16_t h;
        convert(&v[r], DType::f32, &h, DType::f16, 1);
        c.all_reduce(&h, 1, DType::f16, ReduceOp::sum);
        float back;
        convert(&h, DType::f16, &back, DType::f32, 1);
        ASSERT_EQ(back, 2048.f) << "16-bit sums round at every addition";
      }
      // broadcast from a rank in the other process
      std::vector<float> b(n, static_cast<float>(r));
      c.broadcast(b.data(), n, DType::f32, world - 1);
      ASSERT_EQ(b[n / 2], static_cast<float>(world - 1));
      // all_gather in global rank order
      std::vector<float> mine(n, static_cast<float>(r)), all(n * world);
      c.all_gather(mine.data(), all.data(), n, DType::f32);
      for (int q = 0; q < world; ++q) ASSERT_EQ(all[q * n + n - 1], static_cast<float>(q));
      // reduce_scatter
      std::vector<float> send(n * world, 1.f), recv(n);
      c.reduce_scatter(send.data(), recv.data(), n, DType::f32, ReduceOp::sum);
      ASSERT_EQ(recv[0], static_cast<float>(world));
      // the uneven in-place forms of sharded training: the owner's range has the all-reduce's
      // bits and nothing else changes; every rank gets every owner's range (an empty one too)
      for (DType dt : {DType::f32, DType::bf16}) {
        std::vector<size_t> bounds{0};
        for (int q = 1; q < world; ++q) bounds.push_back(q == 1 ? n / 3 : bounds.back() + (q == 2 ? 0 : n / 4));
        bounds.push_back(n);
        const size_t es = dtype_size(dt);
        std::vector<float> f(n);
        for (size_t i = 0; i < n; ++i) f[i] = value(r, i);
        std::vector<char> in(n * es), want(n * es);
        convert(f.data(), DType::f32, in.data(), dt, n);
        want = in;
        std::vector<char> got = in;
        c.all_reduce(want.data(), n, dt, ReduceOp::avg);
        c.reduce_scatter_v_async(got.data(), n, dt, ReduceOp::avg, bounds)->wait();
        const size_t lo = bounds[r], hi = bounds[r + 1];
        ASSERT_EQ(0, std::memcmp(got.data() + lo * es, want.data() + lo * es, (hi - lo) * es)) << dtype_name(dt);
        ASSERT_EQ(0, std::memcmp(got.data(), in.data(), lo * es)) << "written before the owned range";
        ASSERT_EQ(0, std::memcmp(got.data() + hi * es, in.data() + hi * es, (n - hi) * es)) << "written after it";
        c.all_gather_v(got.data(), n, dt, bounds);
        ASSERT_EQ(0, std::memcmp(got.data(), want.data(), n * es)) << "every owner's reduced range, gathered";
      }
      // async, several in flight
      std::vector<std::vector<float>> bufs(4, std::vector<float>(n, 1.f));
      std::vector<WorkHandle> ws;
      for (auto& v : bufs) ws.push_back(c.all_reduce_async(v.data(), n, DType::f32, ReduceOp::sum));
      for (auto& w : ws) w->wait();
      ASSERT_EQ(bufs[3][0], static_cast<float>(world));
      c.barrier();
    });
  }
}

// The node all-reduce's two paths: in place when every process's buffer is in shared pool memory
// (at a different offset in each), copied through the window otherwise (a private buffer, or one
// process's private buffer among shared ones, or a region another process cannot map). Both give
// the same bits (each sums in rank order); a region given back and replaced by a new one is
// mapped again; a region refused once is not tried again.
TEST(Mpi, NodeAllReduceInPlaceAndCopiedGiveTheSameBits) {
  if (!launched_by_mpi()) GTEST_SKIP() << "run under mpirun (tests/mpi/run_mpi_tests.sh)";
  const MpiProcess proc = mpi_process();
  auto node = NodeAllReduce::create(MPI_COMM_WORLD, std::chrono::seconds(20), 1);
  if (!node) GTEST_SKIP() << "REPLICA_MPI_SHM=0: no shared window";
  SharedHostUpstream up;
  const size_t n = 3 * NodeAllReduce::kUnitFloats + 4097;  // several units and a ragged tail
  const size_t bytes = (n + 64) * sizeof(float);
  // Multiples of 1/64 below 2^10: every sum is exact, whatever the order.
  auto term = [](int rank, size_t i) { return static_cast<float>(static_cast<int>((i * 2654435761u) % 2001) - 1000) / 64.f + rank; };
  auto want = [&](size_t i, bool max) {
    float w = term(0, i);
    for (int q = 1; q < proc.size; ++q) w = max ? std::max(w, term(q, i)) : w + term(q, i);
    return w;
  };
  for (bool max : {false, true}) {
    auto* region = static_cast<float*>(up.allocate(bytes));
    SharedRegion where;
    ASSERT_TRUE(find_shared_region(region, bytes, &where)) << "memfd_create failed";
    float* shared = region + 37 + 5 * proc.rank;
    std::vector<float> copied(n);
    for (size_t i = 0; i < n; ++i) shared[i] = copied[i] = term(proc.rank, i);
    node->all_reduce(shared, n, max, "in place");
    node->all_reduce(copied.data(), n, max, "copied");
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(shared[i], copied[i]) << "in place against copied, max=" << max << " i=" << i;
      ASSERT_EQ(copied[i], want(i, max)) << "max=" << max << " i=" << i;
    }
    up.deallocate(region, bytes);  // the next round's region is a new one
  }
  EXPECT_EQ(node->in_place_count(), 2u);
  EXPECT_EQ(node->copied_count(), 2u);
  auto* region = static_cast<float*>(up.allocate(bytes));
  std::vector<float> own(n);
  float* mixed = proc.rank == 0 ? region : own.data();
  for (size_t i = 0; i < n; ++i) mixed[i] = term(proc.rank, i);
  node->all_reduce(mixed, n, false, "mixed");
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(mixed[i], want(i, false)) << "mixed, i=" << i;
  EXPECT_EQ(node->in_place_count(), 2u);
  EXPECT_EQ(node->copied_count(), 3u);
  up.deallocate(region, bytes);
  // A region the others cannot map (process 1's descriptor now names /dev/null, which mmap
  // refuses): process 0 says so, and every process copies, with the right sum.
  auto* unmappable = static_cast<float*>(up.allocate(bytes));
  SharedRegion where;
  ASSERT_TRUE(find_shared_region(unmappable, bytes, &where));
  if (proc.rank == 1) {
    const int null_fd = open("/dev/null", O_RDWR);
    ASSERT_GE(null_fd, 0);
    ASSERT_EQ(dup2(null_fd, where.fd), where.fd);
    close(null_fd);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  for (size_t i = 0; i < n; ++i) unmappable[3 + i] = term(proc.rank, i);
  node->all_reduce(unmappable + 3, n, false, "unmappable");
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(unmappable[3 + i], want(i, false)) << "unmappable, i=" << i;
  EXPECT_EQ(node->in_place_count(), 2u);
  EXPECT_EQ(node->copied_count(), 4u);
  node->all_reduce(unmappable + 3, n, false, "refused before");  // refused at once, no new attempt
  EXPECT_EQ(node->copied_count(), 5u);
  up.deallocate(unmappable, bytes);
  // 16 bits in place: quarters below 32, exact in f16 and bf16 and in every sum
  for (DType dt : {DType::f16, DType::bf16}) {
    auto* region16 = static_cast<uint16_t*>(up.allocate(bytes));
    std::vector<float> f(n), back(n);
    for (size_t i = 0; i < n; ++i) f[i] = static_cast<float>(i % 61) / 4.f - 7.f + proc.rank;
    convert(f.data(), DType::f32, region16 + 9, dt, n);
    ASSERT_TRUE(node->all_reduce16(region16 + 9, n, dt, "16-bit in place")) << dtype_name(dt);
    convert(region16 + 9, dt, back.data(), DType::f32, n);
    for (size_t i = 0; i < n; ++i) {
      float w = 0;
      for (int q = 0; q < proc.size; ++q) w += static_cast<float>(i % 61) / 4.f - 7.f + q;
      ASSERT_EQ(back[i], w) << dtype_name(dt) << " i=" << i;
    }
    up.deallocate(region16, bytes);
  }
  std::vector<uint16_t> private16(n);
  EXPECT_FALSE(node->all_reduce16(private16.data(), n, DType::bf16, "16-bit private")) << "MPI's, not in place";
  EXPECT_EQ(node->in_place_count(), 4u);
}

TEST(Mpi, AFailingRankTakesTheJobDown) {
  if (g_fail_rank < 0) GTEST_SKIP() << "only with --fail-rank N";
  ReplicaGroup group(parse_devices("cpu:1"), {});
  group.run([&](Replica& rep) {
    for (int step = 0; step < 1000; ++step) {
      if (rep.rank() == g_fail_rank && step == 3) throw std::runtime_error("planted failure at step 3");
      float v = 1.f;
      rep.psum(&v, 1);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  FAIL() << "the job should have been aborted";
}

TEST(Mpi, AStoppedRankIsNamedByTheOthers) {
  // Global rank N stops taking part (as under SIGSTOP): the others time out and name it.
  if (g_stall_rank < 0) GTEST_SKIP() << "only with --stall-rank N";
  GroupOptions o;
  o.comm_timeout = std::chrono::seconds(3);
  ReplicaGroup group(parse_devices("cpu:1"), o);
  group.run([&](Replica& rep) {
    for (int step = 0; step < 1000; ++step) {
      if (rep.rank() == g_stall_rank && step == 3) std::this_thread::sleep_for(std::chrono::seconds(60));
      float v = 1.f;
      rep.psum(&v, 1);
    }
  });
  FAIL() << "the job should have been aborted";
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--fail-rank") g_fail_rank = std::atoi(argv[i + 1]);
    else if (std::string(argv[i]) == "--stall-rank") g_stall_rank = std::atoi(argv[i + 1]);
  if (g_fail_rank >= 0) ::testing::GTEST_FLAG(filter) = "Mpi.AFailingRankTakesTheJobDown";
  else if (g_stall_rank >= 0) ::testing::GTEST_FLAG(filter) = "Mpi.AStoppedRankIsNamedByTheOthers";
  else ::testing::GTEST_FLAG(filter) = "Mpi.EveryCollective*:Mpi.NodeAllReduce*";
  int rc = RUN_ALL_TESTS();
  return rc;
}
