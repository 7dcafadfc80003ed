// Schedule arithmetic.
#include "optim/schedule.h"

#include <algorithm>
#include <cmath>

#include "core/errors.h"

namespace replica::optim {

void validate(const ScheduleOptions& o) {
  if (o.kind != "constant" && o.kind != "step" && o.kind != "cosine" && o.kind != "poly")
    throw ConfigError("optim.schedule: '" + o.kind + "' is not a schedule; use constant, step, cosine or poly");
  if (!(o.base_lr > 0)) throw ConfigError("optim.lr: must be > 0, got " + std::to_string(o.base_lr));
  if (o.warmup_steps < 0) throw ConfigError("optim.warmup_steps: must be >= 0");
  if ((o.kind == "cosine" || o.kind == "poly") && o.total_steps <= 0)
    throw ConfigError("optim.schedule: " + o.kind + " needs the total number of steps (> 0)");
  if (o.kind == "poly" && !(o.power > 0))
    throw ConfigError("optim.poly_power: must be > 0, got " + std::to_string(o.power));
  if (!std::is_sorted(o.milestones.begin(), o.milestones.end()))
    throw ConfigError("optim.milestones: must be increasing");
}

float lr_at(const ScheduleOptions& o, int64_t step) {
  double lr = o.base_lr;
  if (o.kind == "step") {
    for (int64_t m : o.milestones)
      if (step >= m) lr *= o.gamma;
  } else if (o.kind == "cosine" || o.kind == "poly") {
    // t: the share of the decay done, from the warm-up's end (0) to total_steps (1).
    double t = std::clamp(static_cast<double>(step - o.warmup_steps) /
                              std::max<int64_t>(1, o.total_steps - o.warmup_steps), 0.0, 1.0);
    lr = o.kind == "cosine" ? o.min_lr + 0.5 * (o.base_lr - o.min_lr) * (1 + std::cos(M_PI * t))
                            : o.min_lr + (o.base_lr - o.min_lr) * std::pow(1.0 - t, static_cast<double>(o.power));
  }
  if (step < o.warmup_steps) {
    double f = o.warmup_start_factor + (1.0 - o.warmup_start_factor) * static_cast<double>(step + 1) / o.warmup_steps;
    lr = o.base_lr * f;
  }
  return static_cast<float>(lr);
}

}  // namespace replica::optim
