// NCCL communicator on the visible GPUs (label gpu; skips without a device): every collective on
// device buffers, checked on the host, the same assertions as the host communicator's tests.
#include <gtest/gtest.h>

#include "core/tensor.h"
#include "parallel/nccl/nccl_communicator.h"
#include "parallel/replica_group.h"

using namespace replica;
using namespace replica::parallel;

TEST(Nccl, CollectivesOnDeviceBuffers) {
  if (cuda_devices().empty()) GTEST_SKIP() << "no CUDA device present";
  if (!nccl_compiled()) GTEST_SKIP() << "built without NCCL";
  GroupOptions o;
  o.cuda_pool.mode = AllocatorMode::growth;
  o.cuda_pool.bytes = size_t(256) << 20;
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
