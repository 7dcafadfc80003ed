// forward_and_loss: forward, f32 softmax cross-entropy, weighted loss gradient.
#include "ops/nn/training_pass.h"

namespace replica::nn {

void forward_and_loss(Context& ctx, Model& model, const Tensor& images, const Tensor& labels,
                      const ops::StepScalar& weight, Tensor& dlogits, const Tensor& sums, float label_smoothing) {
  auto& be = ctx.backend();
  Tensor logits = model.forward(ctx, images);
  Tensor probs = ctx.alloc(logits.shape(), MemTag::activations, DType::f32);  // softmax in f32
  Tensor scratch;
  if (!sums.defined()) {
    scratch = ctx.alloc({3}, MemTag::activations, DType::f32);
    be.fill(scratch, 0.f);
  }
  be.softmax_xent_accumulate(logits, labels, probs, sums.defined() ? sums : scratch, label_smoothing);
  logits = Tensor();
  dlogits = ctx.alloc(probs.shape());
  be.softmax_xent_backward(probs, labels, weight, dlogits, label_smoothing);
}

}  // namespace replica::nn
