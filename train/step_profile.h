// A step profile: what `replica plan` needs to know about one replica's step of this model on
// this device, measured (`replica plan --profile`) or read from a file another machine wrote
// (`--save-profile` there, `--device-profile` here): forward, backward and optimizer times at one
// micro-batch, and for every parameter slot its size and when in backward its gradient was
// final (the order GradientSync's buckets fill in).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "train/config.h"

namespace replica::train {

struct StepProfile {
  std::string model;      // "resnet50 224x224x3, 1000 classes, fp32": a profile plans only its own model
  std::string device;     // where it was measured, e.g. "cpu (AMD EPYC, 1 thread per replica)"
  int64_t micro_batch = 0;
  double forward_s = 0, backward_s = 0, optimizer_s = 0;  // medians over the measured steps
  double compute_sd_s = 0;  // standard deviation of forward + backward over the measured steps
  double host_s = 0;        // per step, outside forward, backward, the wait and the optimizer:
                            // measured here: the finite check and norm pass over the gradients;
                            // from a run's trace: all of the step's host work and data wait
  std::vector<int64_t> slot_elements;  // parameter slots in registration order
  std::vector<double> slot_ready_s;    // seconds into backward when each slot's gradient was final
  int steps = 0;                       // measured steps behind the medians

  int64_t params() const;
  // The same step at micro-batch b: compute times scale linearly with the batch (what a
  // convolution's FLOPs do; small batches on a GPU are slower than that, so measure at the
  // micro-batch the plan uses where possible); the optimizer does not change; the spread scales
  // with the compute.
  StepProfile at_micro_batch(int64_t b) const;
  // The same step on a device that runs `images_per_s` at this micro-batch: every time scaled by
  // one factor (the forward / backward split and the gradients' readiness keep their shape), no
  // spread (the measured machine's noise is not the other device's). For planning hardware that
  // is not at hand from one published throughput figure.
  StepProfile scaled_to(double images_per_s) const;
  std::string json() const;
  static StepProfile from_json(const std::string& text, const std::string& source);
};

// "resnet20 28x28x1, 10 classes, fp32": what a profile must match to plan a configuration.
std::string profile_model_key(const RunConfig& cfg);
// A profile from a `replica train --trace` file of a run of `cfg` (its configuration): replica 0's
// forward, synchronised backward and optimizer slices, its "gradients ready" instants, and the
// step period (host_s), medians over the steps after the first two. The parameter sizes come from
// the model `cfg` builds. A trace of another model, or one without the instants (written before
// they existed, or of a run with one replica and accumulation only), is a named ConfigError.
StepProfile profile_from_trace(const std::string& trace_json, const std::string& source, const RunConfig& cfg);
// Measures `steps` training steps (after 2 unmeasured) of one replica of `cfg` at micro-batch
// `micro` on the configuration's first device, in a scratch pool: no data loading, no
// communication; the step's finite check and norm pass are timed as host_s. A CPU replica runs
// with parallel.intra_op_threads threads, as in training.
StepProfile measure_step_profile(const RunConfig& cfg, int64_t micro, int steps = 5);

}  // namespace replica::train
