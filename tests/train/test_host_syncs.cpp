// The training step's host synchronisation budget: one per optimizer step, whatever the replica
// count, accumulation, precision, sync-BN, clipping, optimizer (SGD, AdamW, LARS) or wire dtype (the loss, accuracy,
// finite check, grad norm and stop vote are read in one copy). The counter is the backend's
// (ops::host_syncs_on_this_thread), kept by the CPU backend exactly as by the CUDA one, so this
// CPU test holds the GPU path's design; the GPU twin is in tests/ops/test_cuda_conformance.cpp.
#include <gtest/gtest.h>

#include <limits>

#include "core/pools.h"
#include "support/host_sync_probe.h"

using namespace replica;

namespace {
void expect_one_per_step(const replica::testing::SyncProbe& p, const char* what) {
  const auto syncs = replica::testing::host_syncs_per_step(p);
  ASSERT_FALSE(syncs.empty()) << what;
  for (size_t i = 0; i < syncs.size(); ++i)
    EXPECT_EQ(syncs[i], 1) << what << ": replica-step " << i << " synchronised with the host " << syncs[i] << " times";
}
}  // namespace

TEST(HostSyncs, OnePerOptimizerStep) {
  expect_one_per_step({.devices = "cpu:1", .accumulation = 1}, "1 replica");
  expect_one_per_step({.devices = "cpu:2", .accumulation = 2}, "2 replicas, accumulation 2");
  expect_one_per_step({.devices = "cpu:2", .activations = DType::f16, .clip_grad_norm = 0.5},
                      "fp16 with a loss scaler and clipping");
  expect_one_per_step({.devices = "cpu:2", .activations = DType::bf16, .sync_bn = true, .optimizer = "adamw",
                       .grad_wire = DType::f16},
                      "bf16, sync-BN, AdamW, fp16 wire");
  expect_one_per_step({.devices = "cpu:2", .optimizer = "lars"}, "LARS (its trust ratios stay on the device)");
}

// The counter itself: every call that hands a value to the host counts, so the test above fails
// when the step gains one (a test that could not fail would hold nothing).
TEST(HostSyncs, EveryCallReturningAValueCounts) {
  auto pool = make_pool(Device{DeviceKind::cpu, 0}, {});
  auto& be = ops::backend_for(Device{DeviceKind::cpu, 0});
  Tensor g = Tensor::empty(*pool, {16}, DType::f32, MemTag::other);
  Tensor one = Tensor::empty(*pool, {1}, DType::f32, MemTag::other);
  be.fill(g, 0.5f);
  be.fill(one, 0.f);
  Tensor logits = Tensor::empty(*pool, {2, 8}, DType::f32, MemTag::other);
  Tensor probs = Tensor::empty(*pool, {2, 8}, DType::f32, MemTag::other);
  Tensor labels = Tensor::empty(*pool, {2}, DType::i32, MemTag::other);
  be.fill(logits, 0.1f);
  labels.data<int32_t>()[0] = 1;
  labels.data<int32_t>()[1] = 7;
  Tensor sums = Tensor::empty(*pool, {3}, DType::f32, MemTag::other);
  be.fill(sums, 0.f);
  int64_t n = ops::host_syncs_on_this_thread();
  auto counted = [&](const char* what) {
    const int64_t now = ops::host_syncs_on_this_thread();
    EXPECT_EQ(now - n, 1) << what;
    n = now;
  };
  auto silent = [&](const char* what) {
    EXPECT_EQ(ops::host_syncs_on_this_thread(), n) << what << " leaves its result on the device";
  };
  be.sum_squares(g);
  counted("sum_squares");
  be.segment_sum_squares(g, {{0, 8}, {8, 8}});
  counted("segment_sum_squares");
  be.unscale_check_finite(g, 1.f);
  counted("unscale_check_finite");
  be.softmax_xent_forward(logits, labels, probs);
  counted("softmax_xent_forward");
  float host[3];
  be.read_to_host(sums, host);
  counted("read_to_host");
  be.sum_squares_into(g, one);
  silent("sum_squares_into");
  be.fill(one, 0.f);
  be.unscale_check_finite_into(g, 1.f, one);
  silent("unscale_check_finite_into");
  be.softmax_xent_accumulate(logits, labels, probs, sums, 0.f);
  silent("softmax_xent_accumulate");
  // The device-result forms agree with the returning ones.
  EXPECT_EQ(one.data<float>()[0], 0.f) << "all finite: the flag stays down";
  be.sum_squares_into(g, one);
  EXPECT_FLOAT_EQ(one.data<float>()[0], static_cast<float>(be.sum_squares(g)));
  const auto r = be.softmax_xent_forward(logits, labels, probs);
  EXPECT_FLOAT_EQ(sums.data<float>()[0], static_cast<float>(r.loss_sum));
  EXPECT_FLOAT_EQ(sums.data<float>()[1], static_cast<float>(r.correct));
  g.data<float>()[3] = std::numeric_limits<float>::infinity();
  be.fill(one, 0.f);
  be.unscale_check_finite_into(g, 1.f, one);
  EXPECT_EQ(one.data<float>()[0], 1.f) << "a non-finite gradient raises the flag";
}
