// Counts the host synchronisations of a real training step (ops::host_syncs_on_this_thread) on
// every replica of a group: the probe behind the one-sync-per-step contract, shared by the CPU
// test (tests/train/test_host_syncs.cpp) and the GPU one (tests/ops/test_cuda_conformance.cpp).
#pragma once
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"
#include "ops/backend.h"
#include "ops/models/resnet.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "parallel/replica_group.h"
#include "train/replica_step.h"

namespace replica::testing {

struct SyncProbe {
  std::string devices = "cpu:2";
  int steps = 3;
  int accumulation = 2;
  DType activations = DType::f32;  // f16: with a dynamic loss scaler
  bool sync_bn = false;
  std::string optimizer = "sgd";  // sgd, adamw or lars
  double clip_grad_norm = 0;
  DType grad_wire = DType::f32;
};

// Host syncs per optimizer step, one entry per (replica, step).
inline std::vector<int64_t> host_syncs_per_step(const SyncProbe& p) {
  parallel::GroupOptions go;
  go.latency_lane = p.sync_bn;
  parallel::ReplicaGroup group(parse_devices(p.devices), go);
  std::vector<std::vector<int64_t>> per(static_cast<size_t>(group.size()));
  group.run([&](parallel::Replica& rep) {
    auto model = models::make_resnet({.arch = "resnet20", .height = 8, .width = 8, .base_width = 4});
    model->materialize(rep.pool(), 1, p.activations);
    std::unique_ptr<optim::Optimizer> opt;
    if (p.optimizer == "adamw")
      opt = std::make_unique<optim::AdamW>(model->registry(), model->num_params(), rep.pool(), optim::AdamWOptions{});
    else if (p.optimizer == "lars")
      opt = std::make_unique<optim::Lars>(model->registry(), model->num_params(), rep.pool(), optim::LarsOptions{});
    else opt = std::make_unique<optim::Sgd>(model->registry(), model->num_params(), rep.pool(), optim::SgdOptions{.momentum = 0.9f});
    optim::DynamicLossScaler scaler({.init_scale = 1024.f});
    train::StepOptions so{.accumulation = p.accumulation, .micro_batch = 4, .sync_bn = p.sync_bn,
                          .activations = p.activations,
                          .scaler = p.activations == DType::f16 ? &scaler : nullptr,
                          .clip_grad_norm = p.clip_grad_norm};
    so.buckets.wire = p.grad_wire;
    so.buckets.bucket_mb = 0.01;  // several buckets, so the per-bucket wait is exercised
    so.buckets.first_bucket_mb = 0.01;
    train::ReplicaStep rs(rep, *model, *opt, so);
    // Inputs made before counting (a host-to-device copy of a batch is not the step's business).
    std::vector<std::pair<Tensor, Tensor>> batches;
    std::mt19937 rng(7 + rep.rank());
    std::normal_distribution<float> d;
    for (int i = 0; i < p.accumulation; ++i) {
      std::vector<float> x(4 * 8 * 8);
      std::vector<int32_t> y(4);
      for (auto& v : x) v = d(rng);
      for (auto& v : y) v = static_cast<int32_t>(rng() % 10);
      Tensor tx = Tensor::empty(rep.pool(), {4, 8, 8, 1}, DType::f32, MemTag::data);
      Tensor ty = Tensor::empty(rep.pool(), {4}, DType::i32, MemTag::data);
      tensor_from_bytes(tx, x.data(), x.size() * sizeof(float));
      tensor_from_bytes(ty, y.data(), y.size() * sizeof(int32_t));
      batches.emplace_back(tx, ty);
    }
    rep.stream().synchronize();
    for (int s = 0; s < p.steps; ++s) {
      const int64_t before = ops::host_syncs_on_this_thread();
      rs.zero_grad();
      for (int k = 0; k < p.accumulation; ++k)
        rs.micro_step(batches[k].first, batches[k].second, k == p.accumulation - 1);
      rs.apply(0.01f);
      per[rep.local_index()].push_back(ops::host_syncs_on_this_thread() - before);
    }
  });
  std::vector<int64_t> out;
  for (auto& v : per) out.insert(out.end(), v.begin(), v.end());
  return out;
}

}  // namespace replica::testing
