// `replica bench kernels`: the memory-bound ops of the backend (batch norm, ReLU, add, casts,
// axpy, pooling) on ResNet-50's activation shapes and the optimizers' updates over its parameters, each judged by the bytes it must move over its time,
// beside a device copy of the same tensor on the same device (the copy rate is what such an op
// can reach). The way a kernel is judged on any GPU, and the same table on CPU.
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "apps/bench.h"
#include "core/cuda/runtime.h"
#include "core/errors.h"
#include "core/pools.h"
#include "ops/backend.h"
#include "ops/cuda/cudnn_fused_bn.h"
#include "ops/models/resnet.h"
#include "optim/optimizer.h"

namespace replica::apps {
namespace {

using Clock = std::chrono::steady_clock;

// Times `fn` (reps runs after 2 unmeasured ones): device time between timing events on a GPU,
// the host clock on CPU. Seconds per run, the best of 3 bursts (shared machines are noisy).
double time_op(bool gpu, int reps, const std::function<void()>& fn) {
  for (int i = 0; i < 2; ++i) fn();
  double best = 1e30;
  for (int burst = 0; burst < 3; ++burst) {
    if (gpu) {
      cuda::StreamTimer t;
      const int a = t.mark();
      for (int i = 0; i < reps; ++i) fn();
      const int b = t.mark();
      t.synchronize();
      best = std::min(best, t.seconds(a, b) / reps);
    } else {
      const auto t0 = Clock::now();
      for (int i = 0; i < reps; ++i) fn();
      best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count() / reps);
    }
  }
  return best;
}

// One row of the table: an op, the bytes it must move at the least, and a run of it.
struct Op {
  const char* name;
  double bytes;
  std::function<void()> run;
  bool own = true;  // the backend's kernel (judged by the slowest figure); false: cuDNN's, beside it
};

// Times and prints each row under `label`, against the first row (the copy of the same bytes);
// returns the slowest of the backend's own rows' fraction of the copy rate (cuDNN's rows are beside them).
double print_rows(const std::string& label, const std::vector<Op>& rows, bool gpu, int reps) {
  double copy_gbs = 0, worst = 1e30;
  for (const Op& op : rows) {
    const double t = time_op(gpu, reps, op.run);
    const double gbs = op.bytes / t / 1e9;
    if (copy_gbs == 0) copy_gbs = gbs;
    const double vs = gbs / copy_gbs;
    if (&op != &rows.front() && op.own) worst = std::min(worst, vs);
    std::printf("%-12s %-34s %10.1f %10.1f %9.1f %7.0f%%\n", label.c_str(), op.name, op.bytes / 1e6, t * 1e6, gbs,
                100 * vs);
  }
  std::fflush(stdout);
  return worst;
}

// The activation ops on one of ResNet-50's shapes [N, H, W, C] in storage dtype dt.
double bench_shape(ops::Backend& be, MemoryPool& pool, int64_t N, int64_t H, int64_t W, int64_t C, DType dt, bool gpu,
                   int reps) {
  const Shape sh{N, H, W, C};
  const int64_t n = sh.numel();
  const double es = static_cast<double>(dtype_size(dt)), nb = static_cast<double>(n) * es;
  auto act = [&] { return Tensor::empty(pool, sh, dt, MemTag::activations); };
  auto chan = [&](float v) {
    Tensor t = Tensor::empty(pool, {C}, DType::f32, MemTag::params);
    be.fill(t, v);
    return t;
  };
  Tensor x = act(), y = act(), dy = act(), dx = act(), r = act();
  be.fill(x, 0.5f), be.fill(dy, 0.25f), be.fill(r, 1.f);
  Tensor xf = Tensor::empty(pool, sh, DType::f32, MemTag::activations);
  be.fill(xf, 0.5f);
  Tensor gamma = chan(1.f), beta = chan(0.f), mean = chan(0.f), invstd = chan(1.f), rm = chan(0.f), rv = chan(1.f);
  Tensor dgamma = chan(0.f), dbeta = chan(0.f);
  std::vector<Op> rows = {
      {"copy (reference)", 2 * nb, [&] { copy_tensor(x, y); }},
      {"relu", 2 * nb, [&] { be.relu_forward(x, y); }},
      {"relu backward", 3 * nb, [&] { be.relu_backward(r, dy, dx); }},
      {"add + relu", 3 * nb, [&] { be.add_relu(x, r, y); }},
      {"axpy (y += a x)", 3 * nb, [&] { be.axpy(1.f, x, y); }},
      {"cast f32 -> storage", nb + 4.0 * n, [&] { be.cast(xf, y); }},
      {"batch norm forward (train)", 3 * nb,
       [&] { be.batchnorm_forward_train(x, gamma, beta, y, mean, invstd, rm, rv, 0.1f, 1e-5f, nullptr, Tensor(), false); }},
      {"batch norm + relu forward", 3 * nb,
       [&] { be.batchnorm_forward_train(x, gamma, beta, y, mean, invstd, rm, rv, 0.1f, 1e-5f, nullptr, Tensor(), true); }},
      {"batch norm + add + relu forward", 4 * nb,  // a residual block's join, one pass
       [&] { be.batchnorm_forward_train(x, gamma, beta, y, mean, invstd, rm, rv, 0.1f, 1e-5f, nullptr, r, true); }},
      {"batch norm backward", 5 * nb,
       [&] { be.batchnorm_backward(dy, x, gamma, mean, invstd, dx, dgamma, dbeta, nullptr, Tensor()); }},
      {"batch norm + relu backward", 7 * nb,  // the mask read and dy written back masked (in place)
       [&] { be.batchnorm_backward(dy, x, gamma, mean, invstd, dx, dgamma, dbeta, nullptr, r); }},
  };
  // cuDNN's own fused join beside the backend's (#40: which one the backend uses is chosen by
  // this table): the same outputs, relu(bn(x) + residual) forward; batch norm's input gradient and
  // the residual's (the masked dy) backward. Where cuDNN does not serve the shape or dtype, a line
  // says what it answered.
  ops::CudnnJoin cj;
  if (gpu && dt != DType::f32) {
    try {
      cj = {.x = x, .residual = r, .y = Tensor::empty(pool, sh, dt, MemTag::activations), .gamma = gamma, .beta = beta,
            .save_mean = mean, .save_invstd = invstd, .running_mean = rm, .running_var = rv};
      const size_t reserve = ops::cudnn_join_reserve_bytes(x);
      if (reserve) cj.reserve = Tensor::empty(pool, {static_cast<int64_t>(reserve)}, DType::u8, MemTag::workspace);
      cj.dy = dy, cj.dx = Tensor::empty(pool, sh, dt, MemTag::activations);
      cj.dresidual = Tensor::empty(pool, sh, dt, MemTag::activations), cj.dgamma = dgamma, cj.dbeta = dbeta;
      ops::cudnn_join_forward(cj, 0.1f, 1e-5f, pool);
      ops::cudnn_join_backward(cj, 1e-5f, pool);
      rows.push_back(
          {"cuDNN bn + add + relu forward (Ex)", 4 * nb, [&] { ops::cudnn_join_forward(cj, 0.1f, 1e-5f, pool); }, false});
      rows.push_back(
          {"cuDNN bn + add + relu backward (Ex)", 5 * nb, [&] { ops::cudnn_join_backward(cj, 1e-5f, pool); }, false});
    } catch (const std::exception& e) {
      std::printf("%-12s (cuDNN's fused join not timed: %s)\n",
                  (std::to_string(H) + "x" + std::to_string(W) + "x" + std::to_string(C)).c_str(), e.what());
    }
  }
  Tensor stem, argmax;  // ResNet-50's stem pooling: 3x3 stride 2 from 112x112x64 to this shape
  if (H == 56 && C == 64) {
    stem = Tensor::empty(pool, {N, 2 * H, 2 * W, C}, dt, MemTag::activations);
    argmax = Tensor::empty(pool, sh, DType::i32, MemTag::activations);
    be.fill(stem, 0.5f);
    const auto pg = ops::PoolGeom::make(stem.shape(), 3, 2, 1, "bench");
    rows.push_back({"max pool 3x3/2 from 112x112", 5 * nb + 4.0 * n, [&, pg] { be.maxpool_forward(stem, y, argmax, pg); }});
    rows.push_back({"max pool backward", 5 * nb + 4.0 * n, [&, pg] { be.maxpool_backward(dy, argmax, stem, pg); }});
  }
  return print_rows(std::to_string(H) + "x" + std::to_string(W) + "x" + std::to_string(C), rows, gpu, reps);
}

// The optimizers' one call a step over ResNet-50's flat buffer (25.6M parameters, every group),
// writing the 16-bit compute copy when the storage dtype is 16-bit; the reference is a copy of the
// f32 parameters. Bytes: parameters, gradients and state read, parameters and state written.
double bench_optimizers(ops::Backend& be, MemoryPool& pool, DType dt, bool gpu, int reps) {
  models::ResNetConfig mc;
  mc.arch = "resnet50";
  mc.in_channels = 3;
  mc.height = mc.width = 224;
  mc.num_classes = 1000;
  auto model = models::make_resnet(mc);
  const int64_t n = model->num_params();
  Tensor params = Tensor::empty(pool, {n}, DType::f32, MemTag::params);
  Tensor grads = Tensor::empty(pool, {n}, DType::f32, MemTag::grads);
  Tensor other = Tensor::empty(pool, {n}, DType::f32, MemTag::other);
  be.fill(params, 0.01f), be.fill(grads, 1e-3f);
  Tensor copy = dt == DType::f32 ? Tensor() : Tensor::empty(pool, {n}, dt, MemTag::params);
  const double w = 4.0 * static_cast<double>(n), cb = copy.defined() ? 2.0 * static_cast<double>(n) : 0.0;
  optim::SgdOptions so;
  so.nesterov = false;
  so.no_decay_bn_bias = true;
  optim::Sgd sgd(model->registry(), n, pool, so);
  optim::AdamW adamw(model->registry(), n, pool, optim::AdamWOptions{});
  optim::Lars lars(model->registry(), n, pool, optim::LarsOptions{});
  const std::vector<Op> rows = {
      {"copy of the f32 parameters", 2 * w, [&] { copy_tensor(params, other); }},
      {"sgd update (no_decay_bn_bias)", 5 * w + cb, [&] { sgd.step(params, grads, 1e-9f, copy); }},
      {"adamw update", 7 * w + cb, [&] { adamw.step(params, grads, 1e-9f, copy); }},
      {"lars ratios + update", 7 * w + cb, [&] { lars.step(params, grads, 1e-9f, copy); }},
  };
  return print_rows("resnet50 " + std::to_string(n / 1000000) + "M", rows, gpu, gpu ? reps : 1);
}

}  // namespace

int bench_kernels(const KernelBenchOptions& o) {
  const bool gpu = o.kind == "cuda";
  const Device dev = gpu ? Device{DeviceKind::cuda, 0} : Device{DeviceKind::cpu, 0};
  if (gpu && cuda_devices().empty()) throw ConfigError("bench kernels --kind cuda: no CUDA device is visible");
  if (gpu) cuda::set_device(0);
  const DType dt = parse_dtype(o.dtype);
  const int64_t N = o.batch > 0 ? o.batch : (gpu ? 256 : 4);
  PoolOptions po;
  po.mode = AllocatorMode::growth;
  auto pool = make_pool(dev, po);
  ops::Backend& be = ops::backend_for(dev);
  const int reps = gpu ? 20 : 2;
  std::printf("# replica bench kernels on %s (%s), %s, batch %ld: GB/s = bytes the op must move / its time; "
              "vs copy = against a device copy of the same tensor (read + write) on this device\n",
              dev.str().c_str(), be.name().c_str(), dtype_name(dt), static_cast<long>(N));
  std::printf("# %-10s %-34s %10s %10s %9s %8s\n", "shape", "op", "MB moved", "us", "GB/s", "vs copy");
  // ResNet-50's batch-norm / activation shapes: every stage's block output has 802816 elements
  // per image (56x56x256 ... 7x7x2048), and the 64-channel 56x56 inner layers a quarter of that.
  const int64_t shapes[][3] = {{56, 56, 64}, {56, 56, 256}, {28, 28, 512}, {14, 14, 1024}, {7, 7, 2048}};
  double worst = 1e30;
  for (const auto& s : shapes) worst = std::min(worst, bench_shape(be, *pool, N, s[0], s[1], s[2], dt, gpu, reps));
  worst = std::min(worst, bench_optimizers(be, *pool, dt, gpu, reps));
  std::printf("# slowest op against the copy rate: %.0f%%\n", 100 * worst);
  return 0;
}

}  // namespace replica::apps
