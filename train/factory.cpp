// Builders for the model, optimizer and loss scaler a configuration names.
#include "train/factory.h"

#include <string>

#include "core/pools.h"
#include "ops/models/resnet.h"

namespace replica::train {

std::unique_ptr<nn::Model> make_model(const RunConfig& cfg, const Shape& s, int64_t classes) {
  return models::make_resnet({.arch = cfg.model.arch, .in_channels = s[2], .num_classes = classes, .height = s[0],
                              .width = s[1], .base_width = cfg.model.width,
                              .zero_init_residual = cfg.model.zero_init_residual,
                              .checkpoint_every = cfg.model.checkpoint_every});
}

std::unique_ptr<optim::Optimizer> make_optimizer(const OptimConfig& o, nn::Model& model, MemoryPool& pool) {
  auto f = [](double v) { return static_cast<float>(v); };
  if (o.name == "adamw")
    return std::make_unique<optim::AdamW>(
        model.registry(), model.num_params(), pool,
        optim::AdamWOptions{f(o.beta1), f(o.beta2), f(o.eps), f(o.weight_decay), o.no_decay_bn_bias});
  if (o.name == "lars")
    return std::make_unique<optim::Lars>(model.registry(), model.num_params(), pool,
                                         optim::LarsOptions{f(o.momentum), f(o.weight_decay), f(o.trust_coefficient)});
  return std::make_unique<optim::Sgd>(model.registry(), model.num_params(), pool,
                                      optim::SgdOptions{.momentum = f(o.momentum),
                                                        .nesterov = o.nesterov,
                                                        .weight_decay = f(o.weight_decay),
                                                        .decoupled = o.decoupled_weight_decay,
                                                        .no_decay_bn_bias = o.no_decay_bn_bias});
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
