// HostCommunicator: every collective at odd sizes and all float dtypes, bit-identical results
// across ranks and runs, mismatched collectives and time-outs as errors, never a hang.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <random>
#include <thread>

#include "core/errors.h"
#include "parallel/accumulate.h"
#include "parallel/host/host_communicator.h"
#include "parallel/replica_group.h"
#include "parallel/solo_communicator.h"
#include "support/on_ranks.h"

using namespace replica;
using namespace replica::parallel;

namespace {

using replica::testing::on_ranks;

float value(int rank, size_t i) { return std::sin(0.37f * static_cast<float>(i) + rank) * (rank + 1); }

std::vector<float> to_float(const std::vector<uint16_t>& v, DType t) {
  std::vector<float> out(v.size());
  convert(v.data(), t, out.data(), DType::f32, v.size());
  return out;
}

}  // namespace

struct CollCase {
  int world;
  size_t count;
};

class AllReduce : public ::testing::TestWithParam<CollCase> {};

TEST_P(AllReduce, SumAvgMaxAllDtypes) {
  // Plain variables, not a structured binding: lambdas capture them (clang 14 cannot capture bindings).
  const int world = GetParam().world;
  const size_t count = GetParam().count;
  auto comms = make_host_communicators(world);
  std::vector<std::vector<float>> results(world), inputs(world, std::vector<float>(count));
  for (int r = 0; r < world; ++r)  // one table: a vectorised sin may round differently from a scalar one
    for (size_t i = 0; i < count; ++i) inputs[r][i] = value(r, i);
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
    on_ranks(comms, [&](int r, Communicator& c) {
      std::vector<float> buf = inputs[r];
      c.all_reduce(buf.data(), count, DType::f32, op);
      results[r] = buf;
    });
    // Exactly the f32 fold in rank order (then / world for avg, times 1/world when that is
    // exact), at every element: the bits do not depend on which rank reduced which range.
    int64_t wrong = 0;
    for (size_t i = 0; i < count; ++i) {
      float want = inputs[0][i];
      for (int r = 1; r < world; ++r) want = op == ReduceOp::max ? std::max(want, inputs[r][i]) : want + inputs[r][i];
      if (op == ReduceOp::avg)
        want = (world & (world - 1)) == 0 ? want * (1.f / static_cast<float>(world)) : want / static_cast<float>(world);
      wrong += results[0][i] != want;
    }
    EXPECT_EQ(wrong, 0) << reduce_op_name(op);
    for (int r = 1; r < world; ++r) EXPECT_EQ(results[r], results[0]) << "rank " << r << " differs";
  }
  // 16-bit types: 16-bit arithmetic as NCCL does it (communicator.h): each value as stored, the
  // running sum rounded after every addition in rank order; exactly that, on every rank.
  for (DType dt : {DType::f16, DType::bf16}) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg}) {
      std::vector<std::vector<float>> got(world);
      on_ranks(comms, [&](int r, Communicator& c) {
        std::vector<float> f(count);
        for (size_t i = 0; i < count; ++i) f[i] = value(r, i);
        std::vector<uint16_t> h(count);
        convert(f.data(), DType::f32, h.data(), dt, count);
        c.all_reduce(h.data(), count, dt, op);
        got[r] = to_float(h, dt);
      });
      const float pre = op == ReduceOp::avg ? 1.f / static_cast<float>(world) : 1.f;
      int64_t wrong = 0;
      for (size_t i = 0; i < count; i += std::max<size_t>(1, count / 97)) {
        float want = 0;
        for (int r = 0; r < world; ++r) {
          const float term = round_to(round_to(value(r, i), dt) * pre, dt);
          want = r == 0 ? term : round_to(want + term, dt);
        }
        wrong += got[0][i] != want;
      }
      EXPECT_EQ(wrong, 0) << dtype_name(dt) << " " << reduce_op_name(op);
      for (int r = 1; r < world; ++r) EXPECT_EQ(got[r], got[0]);
    }
  }
}

TEST(AllReduce, OnePassSumIsTheRankOrderFoldInPlaceAndAtEveryOffset) {
  // sum_to_all (the f32 sum / avg of the host and node all-reduces): the partial sums of a
  // 32-float chunk in registers, the tail element by element; both must give the scalar fold's
  // bits, in place and into separate outputs, from any start and for any length.
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 100.f);
  for (int R : {1, 2, 3, 4, 5}) {
    for (size_t off : {size_t(0), size_t(1), size_t(13)}) {
      for (size_t n : {size_t(0), size_t(1), size_t(31), size_t(32), size_t(33), size_t(100), size_t(1000)}) {
        for (bool avg : {false, true}) {
          for (bool in_place : {false, true}) {
            std::vector<std::vector<float>> in(R, std::vector<float>(off + n + 3)), out(R);
            for (auto& v : in)
              for (float& x : v) x = nd(rng);
            std::vector<float> want(n);
            for (size_t i = 0; i < n; ++i) {
              float v = in[0][off + i];
              for (int r = 1; r < R; ++r) v += in[r][off + i];
              if (avg) v = (R & (R - 1)) == 0 ? v * (1.f / static_cast<float>(R)) : v / static_cast<float>(R);
              want[i] = v;
            }
            std::vector<const float*> ins(R);
            std::vector<float*> outs(R);
            for (int r = 0; r < R; ++r) {
              out[r] = in_place ? std::vector<float>() : std::vector<float>(in[r].size(), -1.f);
              ins[r] = in[r].data();
              outs[r] = in_place ? in[r].data() : out[r].data();
            }
            const auto orig = in;
            sum_to_all(ins.data(), outs.data(), R, off, n, avg);
            for (int r = 0; r < R; ++r) {
              const float* o = outs[r];
              int64_t wrong = 0;
              for (size_t i = 0; i < n; ++i) wrong += o[off + i] != want[i];
              EXPECT_EQ(wrong, 0) << "R " << R << " off " << off << " n " << n << " avg " << avg << " in place "
                                  << in_place << " rank " << r;
              EXPECT_EQ(o[off + n], in_place ? orig[r][off + n] : -1.f) << "wrote past the range";
              if (off) {
                EXPECT_EQ(o[off - 1], in_place ? orig[r][off - 1] : -1.f) << "wrote before the range";
              }
            }
            if (!in_place) {
              EXPECT_EQ(in, orig) << "an input changed";
            }
          }
        }
      }
    }
  }
}

TEST(AllReduce, SixteenBitSumsRoundAtEveryAdditionAsNcclDoes) {
  // f16 spacing at 2048 is 2: 2048 + 1 rounds back to 2048 (ties to even) at each hop, where an
  // f32 sum would give 2050. The host communicator pins NCCL's 16-bit semantics on a CPU.
  auto comms = make_host_communicators(3);
  std::vector<float> got(3);
  on_ranks(comms, [&](int r, Communicator& c) {
    const float v = r == 0 ? 2048.f : 1.f;
    uint16_t h;
    convert(&v, DType::f32, &h, DType::f16, 1);
    c.all_reduce(&h, 1, DType::f16, ReduceOp::sum);
    convert(&h, DType::f16, &got[r], DType::f32, 1);
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(got[r], 2048.f) << "rank " << r << " (f32 arithmetic would give 2050)";
  // avg pre-multiplies (ncclAvg): 65504 (f16's largest) + 65504 would overflow before a division.
  auto two = make_host_communicators(2);
  on_ranks(two, [&](int r, Communicator& c) {
    const float v = 65504.f;
    uint16_t h;
    convert(&v, DType::f32, &h, DType::f16, 1);
    c.all_reduce(&h, 1, DType::f16, ReduceOp::avg);
    convert(&h, DType::f16, &got[r], DType::f32, 1);
  });
  EXPECT_EQ(got[0], 65504.f) << "the average of two maxima is finite";
}

INSTANTIATE_TEST_SUITE_P(Sizes, AllReduce,
                         ::testing::Values(CollCase{2, 1}, CollCase{2, 7}, CollCase{3, 7}, CollCase{4, 1},
                                           CollCase{4, 1000003}, CollCase{3, 1000003}, CollCase{1, 7}),
                         [](const ::testing::TestParamInfo<CollCase>& i) {
                           return "w" + std::to_string(i.param.world) + "_n" + std::to_string(i.param.count);
                         });

TEST(HostComm, BitIdenticalAcrossRuns) {
  std::vector<float> first;
  for (int run = 0; run < 3; ++run) {
    auto comms = make_host_communicators(4);
    std::vector<float> out;
    on_ranks(comms, [&](int r, Communicator& c) {
      std::vector<float> buf(100003);
      std::mt19937 rng(r);
      std::normal_distribution<float> d;
      for (auto& v : buf) v = d(rng) * 1e3f;
      // random delays so thread timing differs run to run
      std::this_thread::sleep_for(std::chrono::microseconds((run * 7 + r * 13) % 50));
      c.all_reduce(buf.data(), buf.size(), DType::f32, ReduceOp::sum);
      if (r == 2) out = buf;
    });
    if (run == 0) {
      first = out;
    } else {
      EXPECT_EQ(0, std::memcmp(first.data(), out.data(), first.size() * 4)) << "run " << run;
    }
  }
}

TEST(HostComm, BroadcastGatherScatterBarrier) {
  for (size_t count : {size_t(1), size_t(7), size_t(1000003)}) {
    const int world = 3;
    auto comms = make_host_communicators(world);
    on_ranks(comms, [&](int r, Communicator& c) {
      std::vector<float> b(count, static_cast<float>(r + 10));
      c.broadcast(b.data(), count, DType::f32, 1);
      EXPECT_EQ(b[count - 1], 11.f);
      std::vector<float> send(count, static_cast<float>(r)), recv(count * world);
      c.all_gather(send.data(), recv.data(), count, DType::f32);
      for (int q = 0; q < world; ++q) EXPECT_EQ(recv[q * count + count - 1], static_cast<float>(q));
      std::vector<float> rs_send(count * world), rs_recv(count);
      for (size_t i = 0; i < rs_send.size(); ++i) rs_send[i] = static_cast<float>(i % 5 + r);
      c.reduce_scatter(rs_send.data(), rs_recv.data(), count, DType::f32, ReduceOp::sum);
      size_t i0 = r * count;
      EXPECT_EQ(rs_recv[0], static_cast<float>(3 * (i0 % 5) + 0 + 1 + 2));
      std::vector<uint16_t> hb(count);
      float one = static_cast<float>(r + 1);
      for (auto& h : hb) convert(&one, DType::f32, &h, DType::bf16, 1);
      c.broadcast(hb.data(), count, DType::bf16, 2);
      EXPECT_EQ(to_float(hb, DType::bf16)[0], 3.f);
      c.barrier();
    });
  }
}

TEST(HostComm, AsyncOverlapsAndCompletesInOrder) {
  auto comms = make_host_communicators(2);
  on_ranks(comms, [&](int r, Communicator& c) {
    std::vector<std::vector<float>> bufs(8, std::vector<float>(1000, 1.f));
    std::vector<WorkHandle> ws;
    for (auto& b : bufs) ws.push_back(c.all_reduce_async(b.data(), b.size(), DType::f32, ReduceOp::sum));
    for (auto& w : ws) w->wait();
    for (auto& b : bufs) EXPECT_EQ(b[999], 2.f);
  });
}

TEST(HostComm, MismatchedCollectivesAreAnError) {
  auto comms = make_host_communicators(2);
  EXPECT_THROW(on_ranks(comms,
                        [&](int r, Communicator& c) {
                          std::vector<float> b(r == 0 ? 10 : 11);
                          c.all_reduce(b.data(), b.size(), DType::f32, ReduceOp::sum);
                        }),
               CommError);
}

TEST(HostComm, TimeoutNamesTheMissingRank) {
  HostCommOptions o;
  o.timeout = std::chrono::milliseconds(200);
  auto comms = make_host_communicators(3, o);
  auto t0 = std::chrono::steady_clock::now();
  try {
    on_ranks(comms, [&](int r, Communicator& c) {
      if (r == 2) return;  // never joins
      c.barrier();
    });
    FAIL() << "expected a time-out";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("rank(s) 2"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

TEST(ReplicaGroupTest, RunsOnEveryReplicaAndSurfacesErrorsWithRank) {
  GroupOptions o;
  o.cpu_pool.bytes = 64 << 20;
  ReplicaGroup group(parse_devices("cpu:3"), o);
  std::vector<int> seen(3, -1);
  group.run([&](Replica& r) {
    seen[r.rank()] = r.world();
    float v = static_cast<float>(r.rank());
    r.psum(&v, 1);
    EXPECT_EQ(v, 3.f);
    auto all = r.all_gather(&v, 1);
    EXPECT_EQ(all.size(), 3u);
  });
  EXPECT_EQ(seen, std::vector<int>({3, 3, 3}));
  auto t0 = std::chrono::steady_clock::now();
  try {
    group.run([&](Replica& r) {
      if (r.rank() == 1) throw std::runtime_error("planted failure");
      float v = 0;
      r.psum(&v, 1);  // ranks 0 and 2 would wait forever for rank 1
    });
    FAIL() << "expected ReplicaError";
  } catch (const ReplicaError& e) {
    EXPECT_EQ(e.rank(), 1);
    EXPECT_NE(std::string(e.what()).find("planted failure"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("cpu:1"), std::string::npos);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5)) << "no hang";
  EXPECT_THROW(group.run([](Replica&) {}), Error) << "a broken group says so";
}

TEST(SoloCommunicator, AWorldOfOneIsTheIdentity) {
  // What a single GPU replica gets instead of NCCL; the copies work on host memory too.
  auto c = make_solo_communicator();
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->rank(), 0);
  std::vector<float> v{1.f, -2.f, 3.5f};
  c->all_reduce(v.data(), 3, DType::f32, ReduceOp::sum);
  c->all_reduce(v.data(), 3, DType::f32, ReduceOp::avg);
  c->broadcast(v.data(), 3, DType::f32, 0);
  EXPECT_EQ(v, (std::vector<float>{1.f, -2.f, 3.5f}));
  std::vector<float> g(3);
  c->all_gather(v.data(), g.data(), 3, DType::f32);
  EXPECT_EQ(g, v);
  std::vector<float> rs(3);
  c->reduce_scatter(v.data(), rs.data(), 3, DType::f32, ReduceOp::sum);
  EXPECT_EQ(rs, v);
  EXPECT_TRUE(c->all_reduce_async(v.data(), 3, DType::f32, ReduceOp::max)->done());
  EXPECT_THROW(c->broadcast(v.data(), 3, DType::f32, 1), CommError);
  c->abort("test");
  EXPECT_THROW(c->barrier(), CommError);
}
