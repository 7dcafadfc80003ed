// CheckpointPolicy: when a run writes a checkpoint (every checkpoint.every_steps steps, at the end
// of every checkpoint.every_epochs-th epoch, when a stop was voted, and always at the end so that
// nothing trained is lost), where, and how many are kept (checkpoint.keep_last).
#pragma once
#include <cstdint>
#include <string>

#include "train/config.h"

namespace replica::train {

class CheckpointPolicy {
 public:
  CheckpointPolicy(const CheckpointConfig& c, std::string dir, int64_t steps_per_epoch)
      : c_(c), dir_(std::move(dir)), spe_(steps_per_epoch) {}
  const std::string& dir() const { return dir_; }
  // After `step` (global, counted from 1): a step checkpoint, or the one a stop asks for.
  bool after_step(int64_t step, bool stop) const { return stop || (c_.every_steps && step % c_.every_steps == 0); }
  // At an epoch's end, after evaluation; never twice for one step.
  bool at_epoch_end(int64_t step) const {
    return c_.every_epochs && step % spe_ == 0 && (step / spe_) % c_.every_epochs == 0 && last_saved_ != step;
  }
  // The final state, unless it was just saved.
  bool at_end(int64_t step) const { return last_saved_ != step; }
  void saved(int64_t step) { last_saved_ = step; }
  int keep_last() const { return c_.keep_last; }

 private:
  CheckpointConfig c_;
  std::string dir_;
  int64_t spe_;
  int64_t last_saved_ = -1;
};

}  // namespace replica::train
