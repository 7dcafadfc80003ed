// forward_and_loss: forward, f32 softmax cross-entropy, weighted loss gradient.
#include "ops/nn/training_pass.h"

namespace replica::nn {

ops::Backend::LossResult forward_and_loss(Context& ctx, Model& model, const Tensor& images, const Tensor& labels,
                                          float weight, Tensor& dlogits) {
  auto& be = ctx.backend();
  Tensor logits = model.forward(ctx, images);
  Tensor probs = ctx.alloc(logits.shape(), MemTag::activations, DType::f32);  // softmax in f32
  auto r = be.softmax_xent_forward(logits, labels, probs);
  logits = Tensor();
  dlogits = ctx.alloc(probs.shape());
  be.softmax_xent_backward(probs, labels, weight, dlogits);
  return r;
}

}  // namespace replica::nn
