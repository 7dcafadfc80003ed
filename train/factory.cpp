// Builders for the model, optimizer and loss scaler a configuration names.
#include "train/factory.h"

#include <string>

#include "core/pools.h"
#include "ops/models/resnet.h"
#include "parallel/gradient_sync.h"

namespace replica::train {

std::unique_ptr<nn::Model> make_model(const RunConfig& cfg, const Shape& s, int64_t classes) {
  return models::make_resnet({.arch = cfg.model.arch, .in_channels = s[2], .num_classes = classes, .height = s[0],
                              .width = s[1], .base_width = cfg.model.width,
                              .zero_init_residual = cfg.model.zero_init_residual,
                              .checkpoint_every = cfg.model.checkpoint_every});
}

std::unique_ptr<optim::Optimizer> make_optimizer(const OptimConfig& o, nn::Model& model, MemoryPool& pool,
                                                 optim::ShardRange range) {
  auto f = [](double v) { return static_cast<float>(v); };
  if (o.name == "adamw")
    return std::make_unique<optim::AdamW>(
        model.registry(), model.num_params(), pool,
        optim::AdamWOptions{f(o.beta1), f(o.beta2), f(o.eps), f(o.weight_decay), o.no_decay_bn_bias}, range);
  if (o.name == "lars")
    return std::make_unique<optim::Lars>(model.registry(), model.num_params(), pool,
                                         optim::LarsOptions{f(o.momentum), f(o.weight_decay), f(o.trust_coefficient)},
                                         range);
  return std::make_unique<optim::Sgd>(model.registry(), model.num_params(), pool,
                                      optim::SgdOptions{.momentum = f(o.momentum),
                                                        .nesterov = o.nesterov,
                                                        .weight_decay = f(o.weight_decay),
                                                        .decoupled = o.decoupled_weight_decay,
                                                        .no_decay_bn_bias = o.no_decay_bn_bias},
                                      range);
}

parallel::ShardPlan make_shard_plan(const RunConfig& cfg, const nn::Model& model, int world) {
  const auto mode = parallel::parse_shard_mode(cfg.parallel.shard, "parallel.shard");
  std::vector<int64_t> offsets;
  for (const auto& p : model.registry().params()) offsets.push_back(p.offset);
  const int64_t total = model.num_params();
  if (mode == parallel::ShardMode::none) return parallel::plan_shards(mode, total, 1, {}, {});
  parallel::BucketOptions bo;
  bo.bucket_mb = cfg.parallel.bucket_mb;
  bo.first_bucket_mb = cfg.parallel.first_bucket_mb;
  bo.wire = parse_dtype(cfg.parallel.grad_dtype);
  auto inner = [&](std::vector<int64_t> v) {  // cut points strictly inside the buffer
    std::erase_if(v, [&](int64_t x) { return x <= 0 || x >= total; });
    return v;
  };
  const std::vector<int64_t> preferred = inner(parallel::initial_bucket_edges(offsets, total, bo));
  const std::vector<int64_t> allowed = inner(cfg.optim.name == "lars" ? offsets : parallel::norm_blocks(offsets, total));
  return parallel::plan_shards(mode, total, world, preferred, allowed);
}

std::unique_ptr<optim::DynamicLossScaler> make_loss_scaler(const TrainConfig& t) {
  const bool dynamic = t.loss_scale == "dynamic" || (t.loss_scale == "auto" && t.precision == "fp16");
  const bool fixed = t.loss_scale != "auto" && t.loss_scale != "off" && t.loss_scale != "dynamic";
  if (!dynamic && !fixed) return nullptr;
  optim::LossScalerOptions lo;
  lo.dynamic = dynamic;
  lo.init_scale = static_cast<float>(dynamic ? t.loss_scale_init : std::stod(t.loss_scale));
  lo.growth_interval = t.loss_scale_growth_interval;
  lo.min_scale = static_cast<float>(t.loss_scale_min);
  lo.hysteresis = static_cast<int>(t.loss_scale_hysteresis);
  lo.max_floor_overflows = t.loss_scale_max_floor_overflows;
  return std::make_unique<optim::DynamicLossScaler>(lo);
}

PoolOptions pool_options(const MemoryConfig& m, DeviceKind kind) {
  PoolOptions o = default_pool_options(kind);
  if (m.mode) {
    o.mode = parse_allocator_mode(*m.mode, "memory.mode");
    o.mode_source = "memory.mode";
  }
  if (m.fraction) {
    o.fraction = *m.fraction;
    o.fraction_source = "memory.fraction";
  }
  if (m.bytes) o.bytes = *m.bytes;
  return o;
}

}  // namespace replica::train
