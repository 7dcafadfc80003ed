// The host-staged communicator (several GPU replicas on one GPU): each collective's result equals
// the host communicator's, through a staging copy. Run here with host memory on both sides and
// a counting copy, so the staging is visible on a CPU machine; the GPU run is in
// tests/ops/test_cuda_conformance.cpp (two replicas on cuda:0).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "core/dtype.h"
#include "core/errors.h"
#include "parallel/host/host_communicator.h"
#include "parallel/staged_communicator.h"

using namespace replica;
using namespace replica::parallel;

TEST(StagedComm, CollectivesEqualTheHostOnesThroughTheStagingCopy) {
  std::atomic<int> copies{0};
  auto host = make_host_communicators(2, {});
  std::vector<std::unique_ptr<Communicator>> comms;
  for (auto& h : host)
    comms.push_back(make_staged_communicator(std::move(h), [&](void* d, const void* s, size_t n) {
      copies++;
      std::memcpy(d, s, n);
    }));
  EXPECT_TRUE(comms[0]->device_buffers()) << "GradientSync hands it device buffers";
  std::vector<std::vector<float>> sum(2), gathered(2), scattered(2), bcast(2);
  std::vector<std::vector<uint16_t>> half(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      Communicator& c = *comms[r];
      sum[r] = {1.f + r, 10.f * (r + 1), -3.f};
      c.all_reduce(sum[r].data(), 3, DType::f32, ReduceOp::sum);
      float h[2] = {0.5f + r, 1024.f};
      half[r].resize(2);
      convert(h, DType::f32, half[r].data(), DType::f16, 2);
      c.all_reduce(half[r].data(), 2, DType::f16, ReduceOp::avg);
      float mine[2] = {static_cast<float>(r), static_cast<float>(r) + 0.5f};
      gathered[r].resize(4);
      c.all_gather(mine, gathered[r].data(), 2, DType::f32);
      float block[4] = {1.f, 2.f, 3.f + r, 4.f};
      scattered[r].resize(2);
      c.reduce_scatter(block, scattered[r].data(), 2, DType::f32, ReduceOp::sum);
      bcast[r] = {static_cast<float>(r + 7)};
      c.broadcast(bcast[r].data(), 1, DType::f32, 1);
      c.barrier();
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(sum[r], (std::vector<float>{3.f, 30.f, -6.f})) << r;
    float back[2];
    convert(half[r].data(), DType::f16, back, DType::f32, 2);
    EXPECT_EQ(back[0], 1.f) << "16-bit average, as the host communicator (and NCCL) computes it";
    EXPECT_EQ(back[1], 1024.f);
    EXPECT_EQ(gathered[r], (std::vector<float>{0.f, 0.5f, 1.f, 1.5f}));
    EXPECT_EQ(bcast[r], std::vector<float>{8.f});
  }
  EXPECT_EQ(scattered[0], (std::vector<float>{2.f, 4.f}));
  EXPECT_EQ(scattered[1], (std::vector<float>{7.f, 8.f}));
  // in and out for each of the 5 data collectives on 2 ranks
  EXPECT_EQ(copies.load(), 2 * 5 * 2);
}

TEST(StagedComm, RefusesToWrapADeviceCommunicator) {
  auto host = make_host_communicators(1, {});
  auto staged = make_staged_communicator(std::move(host[0]), [](void*, const void*, size_t) {});
  EXPECT_THROW(make_staged_communicator(std::move(staged)), CommError);
}
