// Per-CPU kernel choices made by measurement, not by one vendor's default: whether the avx512
// kernel copy runs its direct convolutions in 512-bit registers (faster on Intel parts with two
// 512-bit FMA units, slower on Zen 4, whose 512-bit FMAs issue as two halves; the bits are the
// same either way). A short calibration on the model's own layer shapes decides, once per CPU
// model: the result is cached in the user's cache directory, REPLICA_DIRECT_ZMM=0|1 still forces
// a choice, and `replica --version` and a CPU run's first lines say which was chosen and why.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "ops/backend.h"

namespace replica::ops {

struct CpuTuning {
  bool zmm = false;       // the avx512 copy's direct kernels in 512-bit registers
  std::string how;        // "REPLICA_DIRECT_ZMM=1", "calibrated now", "cached", "not applicable"
  std::string why;        // the figure behind it: "512-bit 0.94x the 256-bit kernels on ..."
  double ratio = 0;       // time of the 256-bit kernels / time of the 512-bit ones (0: not measured)
  double seconds = 0;     // what the calibration cost (0 when cached or forced)
  std::string line() const;  // one line for a run's start and --version
};

// Where the cache lives: $REPLICA_CACHE_DIR, else $XDG_CACHE_HOME/replica, else ~/.cache/replica;
// the file is cpu-tuning.json.
std::string cpu_tuning_cache_path();

// The width choice from timings: `time_pass(zmm)` runs the model's layers once with that width and
// returns seconds; the widths alternate for `rounds` rounds and each keeps its best time.
// 512-bit wins only by at least `margin` (the 256-bit kernels are the measured default).
CpuTuning choose_direct_width(const std::function<double(bool zmm)>& time_pass, int rounds = 3,
                              double margin = 1.03);

// The choice for this CPU, applied (direct::set_zmm): REPLICA_DIRECT_ZMM when set; else, when the
// avx512 copy runs, the cached result for this CPU model (core/cpu_features.h cpu_model_key) and
// kernel version, else a calibration on `layers` (the model's convolutions; at most ~2 s) whose
// result is written to the cache (atomically; a cache that cannot be written is only skipped).
// `what` names the layers in the cache ("resnet50 224x224x3"). Called once per process: later
// calls return the first result.
CpuTuning tune_cpu_kernels(const std::vector<ConvGeom>& layers, const std::string& what);

// For --version: what a run on this CPU would use now, without measuring.
std::string cpu_tuning_report();

}  // namespace replica::ops
