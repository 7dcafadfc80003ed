// The forward half of one training pass, written once for the replica step, the memory planner
// and the benchmarks: forward, softmax cross-entropy in f32, and the gradient of weight x the
// summed loss into `dlogits`. The caller then runs model.backward(ctx, dlogits) (the step times
// the two halves separately). Logits and probabilities are released before it returns, so
// backward starts with only what it needs. The loss stays on the device: `sums` (f32 [3], see
// Backend::softmax_xent_accumulate) gets this pass's loss sum, correct count and bad-label flag
// added, for the step's one read; without it they go to a scratch tensor and are dropped.
// `weight` may live on the device (ops::StepScalar): the replica step stages it there, so a
// captured pass serves every loss scale. `label_smoothing`: the loss is against
// (1 - e) onehot + e / K (train.label_smoothing).
#pragma once
#include "ops/backend.h"
#include "ops/nn/context.h"
#include "ops/nn/model.h"

namespace replica::nn {

void forward_and_loss(Context& ctx, Model& model, const Tensor& images, const Tensor& labels,
                      const ops::StepScalar& weight, Tensor& dlogits, const Tensor& sums = Tensor(),
                      float label_smoothing = 0.f);

}  // namespace replica::nn
