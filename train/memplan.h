// Memory planner (`replica memplan`, `train.micro_batch: auto`): will a configuration fit, and
// what is the largest micro-batch that does? It measures the real thing instead of modelling it:
// one training step (forward, loss, backward, optimizer) of the configured model, precision and
// options at two small micro-batch sizes on a scratch pool, and extrapolates every tag linearly
// in the batch (activations are linear in it; parameters, gradients and optimizer state are
// constant; workspace is bounded by the convolution's chunking). The loader's prefetched
// batches are added from their exact size.
#pragma once
#include <array>
#include <cstdint>
#include <string>

#include "core/memory_pool.h"
#include "train/config.h"

namespace replica::train {

struct MemPlan {
  int64_t micro_batch = 0;
  int replicas = 1;
  std::string shard = "none";                // parallel.shard the plan was measured with
  bool masters_sharded = false;              // fp32 masters sharded too (a 16-bit precision)
  std::array<double, kNumTags> tag_bytes{};  // peak of each tag during the step, per replica
  double inputs_bytes = 0;                   // prefetched and current input batches
  double peak_bytes = 0;                     // peak in use, per replica
  double overhead_bytes = 0;                 // reserved beyond in use (granularity, regions)
  size_t capacity = 0;                       // the pool's capacity on the configured device
  std::string pool;                          // e.g. "growth up to 17.66 GiB (0.75 of 23.54 GiB host)"
  bool fits = false;
  int64_t max_micro_batch = 0;   // the largest micro-batch that fits (0: not even 1)
  int64_t best_micro_batch = 0;  // the largest that fits and divides global_batch / replicas
  int accumulation = 0;          // accumulation steps with best_micro_batch
  double peak_base = 0, peak_per_sample = 0;  // the fit: peak(b) = base + per_sample * b
  double peak_for(int64_t b) const { return peak_base + peak_per_sample * static_cast<double>(b); }
  std::string report() const;
};

// `micro_batch` 0: the configuration's (global / replicas when it says 0 or auto).
MemPlan plan_memory(const RunConfig& cfg, int64_t micro_batch = 0);

}  // namespace replica::train
