// DynamicLossScaler implementation.
#include "optim/loss_scaler.h"

#include <algorithm>

#include "core/errors.h"

namespace replica::optim {

DynamicLossScaler::DynamicLossScaler(LossScalerOptions o) : o_(o), scale_(o.init_scale), hysteresis_left_(o.hysteresis) {
  if (!(o.init_scale > 0) || !(o.min_scale > 0) || o.growth_interval < 1 || o.hysteresis < 1 ||
      !(o.backoff_factor > 0 && o.backoff_factor < 1) || !(o.growth_factor >= 1))
    throw ConfigError("loss scaler: need init and min scale > 0, growth interval and hysteresis >= 1, "
                      "back-off in (0, 1) and growth >= 1");
}

bool DynamicLossScaler::update(bool finite, int64_t step) {
  if (finite) {
    floor_overflows_ = 0;
    hysteresis_left_ = o_.hysteresis;
    if (o_.dynamic && ++good_ >= o_.growth_interval) {
      scale_ *= o_.growth_factor;
      good_ = 0;
    }
    return true;
  }
  skipped_++;
  good_ = 0;
  if (!o_.dynamic) {
    if (++floor_overflows_ >= o_.max_floor_overflows)
      throw TrainingError("the static loss scale " + std::to_string(scale_) + " overflowed on " +
                          std::to_string(floor_overflows_) + " consecutive steps (last: step " + std::to_string(step) +
                          "); lower train.loss_scale or use dynamic loss scaling");
    return false;
  }
  if (scale_ <= o_.min_scale) {
    if (++floor_overflows_ >= o_.max_floor_overflows)
      throw TrainingError("the loss scale is at its floor (" + std::to_string(o_.min_scale) + ") and gradients "
                          "still overflowed on " + std::to_string(floor_overflows_) + " consecutive steps (last: step " +
                          std::to_string(step) + "): the run has diverged. Lower optim.lr, add warm-up, clip "
                          "gradients (optim.clip_grad_norm) or train in bf16/fp32.");
  }
  if (--hysteresis_left_ <= 0) {
    scale_ = std::max(o_.min_scale, scale_ * o_.backoff_factor);
    hysteresis_left_ = o_.hysteresis;
  }
  return false;
}

void DynamicLossScaler::restore(const State& s) {
  scale_ = s.scale;
  good_ = s.good;
  skipped_ = s.skipped;
  floor_overflows_ = s.floor_overflows;
  hysteresis_left_ = s.hysteresis_left;
}

}  // namespace replica::optim
