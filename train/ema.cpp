// WeightEma: the moving average's update rule and its schedule.
#include "train/ema.h"

#include "core/stream.h"

namespace replica::train {

void ema_update(ops::Backend& be, const Tensor& ema, const Tensor& value, float decay) {
  if (ema.numel() == 0) return;
  be.scale(ema, decay);
  be.axpy(1.f - decay, value, ema);
}

WeightEma::WeightEma(MemoryPool& pool, const Tensor& params, const Tensor& buffers, EmaOptions o) : o_(o) {
  params_ = Tensor::empty(pool, params.shape(), DType::f32, MemTag::optimizer);
  buffers_ = Tensor::empty(pool, buffers.shape(), DType::f32, MemTag::optimizer);
  copy_tensor(params, params_, current_stream());
  copy_tensor(buffers, buffers_, current_stream());
}

void WeightEma::after_step(int64_t applied, const Tensor& params, const Tensor& buffers) {
  if (applied <= o_.warmup_steps) {  // torchvision restarts its average during the lr warm-up
    copy_tensor(params, params_, current_stream());
    copy_tensor(buffers, buffers_, current_stream());
    return;
  }
  if ((applied - o_.warmup_steps) % o_.every != 0) return;
  auto& be = ops::backend_for(params.device());
  const float d = static_cast<float>(o_.decay);
  ema_update(be, params_, params, d);
  ema_update(be, buffers_, buffers, d);
}

}  // namespace replica::train
