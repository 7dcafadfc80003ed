// Learning-rate schedules as a pure function of the applied-step count (skipped steps do not
// advance it): constant, step decay, cosine, polynomial (MLPerf's LARS recipe), each with optional
// linear warm-up.
#pragma once
#include <string>
#include <vector>

namespace replica::optim {

struct ScheduleOptions {
  std::string kind = "constant";  // constant | step | cosine | poly
  float base_lr = 0.1f;
  int64_t warmup_steps = 0;       // linear from warmup_start_factor * base_lr to base_lr
  float warmup_start_factor = 0.0f;
  int64_t total_steps = 0;        // cosine and poly decay to min_lr at total_steps
  float min_lr = 0.f;
  float power = 2.f;              // poly: min_lr + (base - min_lr) (1 - t)^power, t from warm-up's end
  std::vector<int64_t> milestones;  // step: lr *= gamma at each
  float gamma = 0.1f;
};

// Validates (throws ConfigError naming optim.schedule.*).
void validate(const ScheduleOptions& o);
float lr_at(const ScheduleOptions& o, int64_t step);
// Goyal et al.'s linear scaling rule: lr * global_batch / 256.
inline float scaled_lr(float lr, int64_t global_batch) { return lr * static_cast<float>(global_batch) / 256.f; }

}  // namespace replica::optim
