// train.ema_decay: an exponential moving average of the weights, kept beside the live ones as
// torchvision's ExponentialMovingAverage (an AveragedModel with use_buffers) and timm's ModelEma
// keep it: after every `every`-th applied step, ema = decay * ema + (1 - decay) * value for the
// fp32 master weights (this replica's shard of them under parallel.shard) and the batch-norm
// buffers; during the first `warmup_steps` applied steps (the learning rate's warm-up) it is the
// model itself. In f32 on the replica's device, queued on its stream (no host wait); skipped steps
// (fp16 overflow) do not count. The trainer evaluates it beside the live weights, saves it as
// model_ema.bin, and keeps it in every checkpoint (exact resume).
#pragma once
#include <cstdint>

#include "core/memory_pool.h"
#include "core/tensor.h"
#include "ops/backend.h"

namespace replica::train {

struct EmaOptions {
  double decay = 0;  // 0: off
  int64_t every = 1;
  int64_t warmup_steps = 0;
  bool on() const { return decay > 0; }
};

// ema = decay * ema + (1 - decay) * value, in place (f32, the same size), on the thread's stream.
void ema_update(ops::Backend& be, const Tensor& ema, const Tensor& value, float decay);

class WeightEma {
 public:
  // Starts as copies of `params` and `buffers` (the model as it is), from `pool`.
  WeightEma(MemoryPool& pool, const Tensor& params, const Tensor& buffers, EmaOptions o);
  // After applied step number `applied` (1: the first): a copy of the model during the warm-up,
  // an update every `every` steps after it, else nothing.
  void after_step(int64_t applied, const Tensor& params, const Tensor& buffers);
  const Tensor& params() const { return params_; }
  const Tensor& buffers() const { return buffers_; }
  const EmaOptions& options() const { return o_; }

 private:
  EmaOptions o_;
  Tensor params_, buffers_;
};

}  // namespace replica::train
