// DynamicLossScaler: fp16 loss scaling with the anchors' defaults (torch GradScaler, Apex, Flax):
// start at 2^16, x2 after `growth_interval` consecutive good steps, x0.5 on overflow, never below
// `min_scale`; DeepSpeed's hysteresis (tolerate N overflows before backing off) optionally; or a
// static scale. The verdict it is given comes from the all-reduced gradients, so every replica
// makes the same decision. Stuck at the floor and still overflowing is an error, not a dead run.
#pragma once
#include <cstdint>
#include <string>

namespace replica::optim {

struct LossScalerOptions {
  bool dynamic = true;
  float init_scale = 65536.f;
  float growth_factor = 2.f;
  float backoff_factor = 0.5f;
  int64_t growth_interval = 2000;
  float min_scale = 1.f;
  int hysteresis = 1;               // overflows tolerated before a back-off (DeepSpeed uses 2)
  int64_t max_floor_overflows = 50; // consecutive overflows at min_scale before giving up
};

class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(LossScalerOptions o = {});
  float scale() const { return scale_; }
  // Records a step's verdict (true: all gradients finite, the step was applied); returns it.
  // Throws TrainingError when the scale sits at its floor and keeps overflowing.
  bool update(bool finite, int64_t step);
  int64_t good_steps() const { return good_; }
  int64_t skipped() const { return skipped_; }
  const LossScalerOptions& options() const { return o_; }
  // State for checkpoints.
  struct State {
    float scale;
    int64_t good, skipped, floor_overflows;
    int hysteresis_left;
  };
  State state() const { return {scale_, good_, skipped_, floor_overflows_, hysteresis_left_}; }
  void restore(const State& s);

 private:
  LossScalerOptions o_;
  float scale_;
  int64_t good_ = 0, skipped_ = 0, floor_overflows_ = 0;
  int hysteresis_left_;
};

}  // namespace replica::optim
