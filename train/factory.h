// One home for building what a configuration names: the model, the optimizer (by optim.name), the
// loss scaler (by train.loss_scale) and each device's memory options (memory.*). The trainer, the memory planner and the benchmarks all
// build through here, so a new optimizer or option is added once.
#pragma once
#include <memory>

#include "ops/nn/model.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "core/memory/options.h"
#include "parallel/shard_plan.h"
#include "train/config.h"

namespace replica::train {

// The ResNet of model.* for samples of `sample` (H, W, C) and `classes` classes.
std::unique_ptr<nn::Model> make_model(const RunConfig& cfg, const Shape& sample, int64_t classes);
// sgd | adamw | lars with the options of optim.*; its state tensors come from `pool` and cover
// `range` of the flat buffer (a replica's shard under parallel.shard; everything by default).
std::unique_ptr<optim::Optimizer> make_optimizer(const OptimConfig& o, nn::Model& model, MemoryPool& pool,
                                                 optim::ShardRange range = {});
// parallel.shard's plan for `world` replicas of `model`: cut on the initial gradient buckets' edges
// where that keeps every shard within 5% of an even share, else on the gradient norm's block
// edges; LARS on tensor edges only (its trust ratios need whole tensors). Mode none: unsharded.
parallel::ShardPlan make_shard_plan(const RunConfig& cfg, const nn::Model& model, int world);
// The loss scaler train.loss_scale asks for: dynamic ("dynamic", or "auto" with fp16), static (a
// number) or none (null: "off", or "auto" with fp32 / bf16).
std::unique_ptr<optim::DynamicLossScaler> make_loss_scaler(const TrainConfig& t);
// The pool options of a device kind: its default, then the REPLICA_* environment, then memory.*
// (each setting remembers where it came from, for error messages).
PoolOptions pool_options(const MemoryConfig& m, DeviceKind kind);

}  // namespace replica::train
