// The uneven in-place collectives of sharded training (Communicator::reduce_scatter_v and
// all_gather_v) on every in-process communicator: the host one, the host-staged one, and the
// base-class defaults that the MPI communicator uses (through a wrapper that forwards only the
// even collectives). An owner's range gets exactly the all-reduce's bits; nothing outside it is
// written; uneven, empty and unaligned ranges. Then the ShardPlan's cuts and the norm's blocks.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>
#include <thread>

#include "core/errors.h"
#include "core/pools.h"
#include "parallel/gradient_sync.h"
#include "parallel/host/host_communicator.h"
#include "parallel/shard_plan.h"
#include "parallel/solo_communicator.h"
#include "parallel/staged_communicator.h"
#include "support/on_ranks.h"

using namespace replica;
using namespace replica::parallel;
using replica::testing::on_ranks;

namespace {

// Forwards the even collectives to a host communicator and leaves the uneven ones to the
// Communicator defaults: what MpiCommunicator runs, in one process.
class DefaultsOnly : public Communicator {
 public:
  explicit DefaultsOnly(std::unique_ptr<Communicator> c) : c_(std::move(c)) {}
  int rank() const override { return c_->rank(); }
  int size() const override { return c_->size(); }
  std::string name() const override { return "defaults"; }
  WorkHandle all_reduce_async(void* d, size_t n, DType t, ReduceOp op) override { return c_->all_reduce_async(d, n, t, op); }
  WorkHandle broadcast_async(void* d, size_t n, DType t, int root) override { return c_->broadcast_async(d, n, t, root); }
  WorkHandle all_gather_async(const void* s, void* r, size_t n, DType t) override { return c_->all_gather_async(s, r, n, t); }
  WorkHandle reduce_scatter_async(const void* s, void* r, size_t n, DType t, ReduceOp op) override {
    return c_->reduce_scatter_async(s, r, n, t, op);
  }
  WorkHandle barrier_async() override { return c_->barrier_async(); }
  void abort(const std::string& why) override { c_->abort(why); }

 private:
  std::unique_ptr<Communicator> c_;
};

enum class Kind { host, staged, defaults };
const char* kind_name(Kind k) { return k == Kind::host ? "host" : k == Kind::staged ? "staged" : "defaults"; }

std::vector<std::unique_ptr<Communicator>> make(Kind k, int world) {
  auto host = make_host_communicators(world);
  if (k == Kind::host) return host;
  std::vector<std::unique_ptr<Communicator>> out;
  for (auto& h : host) {
    if (k == Kind::staged)
      out.push_back(make_staged_communicator(std::move(h), [](void* d, const void* s, size_t n) { std::memmove(d, s, n); }));
    else
      out.push_back(std::make_unique<DefaultsOnly>(std::move(h)));
  }
  return out;
}

// Uneven cuts of [0, n) for `world` ranks, some of them empty, none aligned.
std::vector<size_t> cuts(size_t n, int world, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<size_t> b{0};
  for (int r = 1; r < world; ++r) b.push_back(n ? g() % (n + 1) : 0);
  b.push_back(n);
  std::sort(b.begin(), b.end());
  if (world >= 3) b[2] = b[1];  // an empty range in the middle
  return b;
}

// Rank r's input bytes: random finite values in `dt`.
std::vector<char> input(int rank, size_t n, DType dt, uint32_t seed) {
  std::mt19937 g(seed * 131 + static_cast<uint32_t>(rank));
  std::uniform_real_distribution<float> u(-4.f, 4.f);
  std::vector<float> f(n);
  for (auto& x : f) x = u(g);
  std::vector<char> out(n * dtype_size(dt));
  convert(f.data(), DType::f32, out.data(), dt, n);
  return out;
}

}  // namespace

struct VCase {
  Kind kind;
  int world;
  size_t count;
};
class ShardedCollectives : public ::testing::TestWithParam<VCase> {};

TEST_P(ShardedCollectives, ReduceScatterVHasTheAllReduceBitsInTheOwnedRangeOnly) {
  const Kind kind = GetParam().kind;
  const int world = GetParam().world;
  const size_t n = GetParam().count;
  for (DType dt : {DType::f32, DType::f16, DType::bf16})
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      const uint32_t seed = static_cast<uint32_t>(n * 7 + world) + static_cast<uint32_t>(op) * 3 + static_cast<uint32_t>(dt);
      const std::vector<size_t> b = cuts(n, world, seed);
      const size_t es = dtype_size(dt);
      // The reference: an all-reduce of the same inputs on the host communicator.
      std::vector<std::vector<char>> want(world), got(world), in(world);
      for (int r = 0; r < world; ++r) want[r] = got[r] = in[r] = input(r, n, dt, seed);
      auto ref = make_host_communicators(world);
      on_ranks(ref, [&](int r, Communicator& c) { c.all_reduce(want[r].data(), n, dt, op); });
      auto comms = make(kind, world);
      on_ranks(comms, [&](int r, Communicator& c) { c.reduce_scatter_v_async(got[r].data(), n, dt, op, b)->wait(); });
      for (int r = 0; r < world; ++r) {
        const size_t lo = b[r], hi = b[r + 1];
        const std::string what = std::string(kind_name(kind)) + " " + dtype_name(dt) + " " + reduce_op_name(op) +
                                 " rank " + std::to_string(r) + " of " + std::to_string(world);
        EXPECT_EQ(0, std::memcmp(got[r].data() + lo * es, want[r].data() + lo * es, (hi - lo) * es))
            << what << ": the owned range is not the all-reduce's bits";
        EXPECT_EQ(0, std::memcmp(got[r].data(), in[r].data(), lo * es)) << what << ": written before its range";
        EXPECT_EQ(0, std::memcmp(got[r].data() + hi * es, in[r].data() + hi * es, (n - hi) * es))
            << what << ": written after its range";
      }
    }
}

TEST_P(ShardedCollectives, AllGatherVGivesEveryRankEveryOwnersRange) {
  const Kind kind = GetParam().kind;
  const int world = GetParam().world;
  const size_t n = GetParam().count;
  for (DType dt : {DType::f32, DType::bf16}) {
    const std::vector<size_t> b = cuts(n, world, static_cast<uint32_t>(n + world));
    const size_t es = dtype_size(dt);
    std::vector<std::vector<char>> buf(world), own(world);
    for (int r = 0; r < world; ++r) {
      own[r] = input(r, n, dt, 99);
      buf[r] = input(r + 100, n, dt, 7);  // garbage outside the owned range
      std::memcpy(buf[r].data() + b[r] * es, own[r].data() + b[r] * es, (b[r + 1] - b[r]) * es);
    }
    auto comms = make(kind, world);
    on_ranks(comms, [&](int r, Communicator& c) { c.all_gather_v(buf[r].data(), n, dt, b); });
    for (int r = 0; r < world; ++r)
      for (int o = 0; o < world; ++o)
        EXPECT_EQ(0, std::memcmp(buf[r].data() + b[o] * es, own[o].data() + b[o] * es, (b[o + 1] - b[o]) * es))
            << kind_name(kind) << " " << dtype_name(dt) << ": rank " << r << " lacks owner " << o << "'s range";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, ShardedCollectives,
    ::testing::Values(VCase{Kind::host, 1, 37}, VCase{Kind::host, 2, 1}, VCase{Kind::host, 3, 37},
                      VCase{Kind::host, 4, 2 * 16384 + 13}, VCase{Kind::host, 5, 1000},
                      VCase{Kind::staged, 2, 37}, VCase{Kind::staged, 3, 16384 + 5},
                      VCase{Kind::defaults, 1, 5}, VCase{Kind::defaults, 3, 37}, VCase{Kind::defaults, 4, 16384 + 5}),
    [](const auto& info) {
      return std::string(kind_name(info.param.kind)) + "_" + std::to_string(info.param.world) + "ranks_" +
             std::to_string(info.param.count);
    });

TEST(ShardedCollectives, BadBoundsAndMismatchedBoundsAreErrors) {
  auto comms = make_host_communicators(2, {std::chrono::milliseconds(2000)});
  std::vector<float> x(8, 1.f);
  EXPECT_THROW(comms[0]->reduce_scatter_v(x.data(), 8, DType::f32, ReduceOp::sum, {0, 9, 8}), CommError);
  EXPECT_THROW(comms[0]->all_gather_v(x.data(), 8, DType::f32, {0, 8}), CommError) << "one bound short";
  // Ranks that pass other bounds for the same collective: an error naming it, not a wrong answer.
  std::vector<std::vector<float>> v(2, std::vector<float>(8, 1.f));
  EXPECT_THROW(on_ranks(comms,
                        [&](int r, Communicator& c) {
                          c.reduce_scatter_v(v[r].data(), 8, DType::f32, ReduceOp::sum, {0, r == 0 ? 3u : 4u, 8});
                        }),
               CommError);
  auto solo = make_solo_communicator();
  EXPECT_NO_THROW(solo->reduce_scatter_v(x.data(), 8, DType::f32, ReduceOp::avg, {0, 8}));
  EXPECT_EQ(x[3], 1.f);
}

TEST(ShardPlan, CutsOnBucketEdgesWithinFivePercentElseOnAllowedPoints) {
  // 10 tensors of 1000 elements; buckets every 3 tensors.
  const int64_t total = 10000;
  std::vector<int64_t> slots;
  for (int64_t o = 0; o < total; o += 1000) slots.push_back(o);
  const std::vector<int64_t> buckets{1000, 4000, 7000};
  // Two ranks: the even cut 5000 is 1000 from a bucket edge (20% of a share): a norm block edge.
  ShardPlan p2 = plan_shards(ShardMode::optimizer, total, 2, buckets, norm_blocks(slots, total, 256));
  EXPECT_EQ(p2.bounds, (std::vector<int64_t>{0, 5000, 10000}));
  // Three ranks: 3333 and 6667 are within 5% of 4000 / 7000? No (20%): block edges again; with
  // a generous tolerance the bucket edges win.
  ShardPlan p3 = plan_shards(ShardMode::optimizer, total, 3, buckets, norm_blocks(slots, total, 256));
  EXPECT_LE(p3.imbalance(), 1.05);
  ShardPlan loose = plan_shards(ShardMode::optimizer, total, 3, buckets, slots, 0.25);
  EXPECT_EQ(loose.bounds, (std::vector<int64_t>{0, 4000, 7000, 10000}));
  // Tensor edges only (LARS): every cut is a tensor's start.
  ShardPlan lars = plan_shards(ShardMode::optimizer, total, 4, {}, slots);
  for (int64_t b : lars.bounds) EXPECT_EQ(b % 1000, 0) << b;
  EXPECT_EQ(lars.bounds.front(), 0);
  EXPECT_EQ(lars.bounds.back(), total);
  // More ranks than cut points: later ranks own nothing, bounds still increase to the end.
  ShardPlan many = plan_shards(ShardMode::gradients, 3000, 5, {}, {1000, 2000});
  for (size_t i = 1; i < many.bounds.size(); ++i) EXPECT_LE(many.bounds[i - 1], many.bounds[i]);
  EXPECT_EQ(many.bounds.back(), 3000);
  EXPECT_EQ(many.bounds, (std::vector<int64_t>{0, 1000, 1000, 2000, 2000, 3000})) << "the nearest allowed points";
  EXPECT_EQ(many.within(500, 2500), (std::vector<size_t>{0, 500, 500, 1500, 1500, 2000}));
  EXPECT_THROW(parse_shard_mode("zero3", "parallel.shard"), ConfigError);
}

TEST(ShardPlan, NormBlocksCoverTheBufferAndHoldEveryTensorEdge) {
  const std::vector<int64_t> slots{0, 10, 5000, 5001};
  const auto b = norm_blocks(slots, 9000, 4096);
  EXPECT_EQ(b, (std::vector<int64_t>{0, 10, 4096, 5000, 5001, 8192, 9000}));
}

TEST(ShardPlan, InitialBucketEdgesAreTheBucketsGradientSyncCuts) {
  std::vector<int64_t> offsets;
  for (int64_t o = 0; o < 64 * 1000; o += 1000) offsets.push_back(o);
  const int64_t total = 64 * 1000;
  auto comms = make_host_communicators(1);
  BucketOptions o;
  o.first_bucket_mb = 0.01;  // ~2.6 tensors
  o.bucket_mb = 0.05;        // ~13 tensors
  auto pool = make_pool(Device{DeviceKind::cpu, 0}, [] {
    PoolOptions p;
    p.mode = AllocatorMode::growth;
    return p;
  }());
  Tensor grads = Tensor::zeros(*pool, {total}, DType::f32, MemTag::grads);  // freed before its pool
  GradientSync sync(offsets, grads, *comms[0], o);
  std::vector<int64_t> want{0, total};
  for (const auto& bk : sync.buckets()) want.push_back(bk.lo);
  std::sort(want.begin(), want.end());
  want.erase(std::unique(want.begin(), want.end()), want.end());
  EXPECT_EQ(initial_bucket_edges(offsets, total, o), want);
}
