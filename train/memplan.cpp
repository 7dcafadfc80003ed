// Memory planner: two measured steps and a linear fit per tag.
#include "train/memplan.h"

#include <cmath>
#include <sstream>

#include "core/errors.h"
#include "core/cuda/runtime.h"
#include "core/pools.h"
#include "ops/models/resnet.h"
#include "ops/nn/training_pass.h"
#include "optim/optimizer.h"
#include "parallel/gradient_sync.h"
#include "parallel/solo_communicator.h"
#include "train/factory.h"
#include "train/trainer.h"

namespace replica::train {

namespace {

struct Measured {
  std::array<double, kNumTags> tags{};
  double peak = 0, reserved = 0;
};

// One training step of micro-batch b on `device`, in a fresh growth pool. On a GPU a first step
// runs unmeasured: it is where cuDNN times its algorithms in transient workspaces that later steps
// do not take.
// parallel.shard: the optimizer state of the largest shard of `replicas` (the replica that fits last).
Measured measure(const RunConfig& cfg, const Shape& sample, int64_t classes, int64_t b, const Device& device,
                 int replicas) {
  PoolOptions po;
  po.mode = AllocatorMode::growth;
  const bool gpu = device.kind == DeviceKind::cuda;
  if (gpu) cuda::set_device(device.index);
  auto pool = make_pool(gpu ? device : Device{DeviceKind::cpu, 0}, po);
  const DType dt = parse_dtype(cfg.train.precision);
  auto model = make_model(cfg, sample, classes);
  model->materialize(*pool, 0, dt);
  const parallel::ShardPlan shard = make_shard_plan(cfg, *model, replicas);
  optim::ShardRange range;
  int largest = 0;
  for (int r = 0; shard.sharded() && r < shard.world(); ++r)
    if (shard.hi(r) - shard.lo(r) > range.hi - range.lo || range.hi < 0) {
      range = {shard.lo(r), shard.hi(r)};
      largest = r;
    }
  if (shard.sharded() && dt != DType::f32) model->shard_masters(range.lo, range.hi);  // as Trainer does
  std::unique_ptr<optim::Optimizer> opt = make_optimizer(cfg.optim, *model, *pool, range);
  // ZeRO-2 as ReplicaStep runs it: no whole gradient buffer, buckets bound as backward reaches
  // them, the largest shard kept. Measured alone, a complete bucket goes once the next one is
  // complete (GradientSync's one-replica release: its reduce-scatter assumed to take as long as
  // backward takes to fill the next bucket). A slower link holds more buckets at once.
  const bool release = shard.mode == parallel::ShardMode::gradients;
  std::unique_ptr<parallel::Communicator> solo;
  std::unique_ptr<parallel::GradientSync> sync;
  Tensor grads = model->grads();
  Tensor comm;
  if (release) {
    std::vector<int64_t> offsets;
    for (const auto& p : model->registry().params()) offsets.push_back(p.offset);
    parallel::BucketOptions bo{cfg.parallel.bucket_mb, cfg.parallel.first_bucket_mb, DType::f32, pool.get()};
    bo.shard = shard.bounds;
    bo.release = true;
    bo.rank = largest;
    bo.rebuild = false;
    bo.bind = [m = model.get()](int slot, const Tensor& g) { m->bind_grad(slot, g); };
    model->release_grads();
    grads = Tensor::zeros(*pool, {std::max<int64_t>(range.hi - range.lo, 1)}, DType::f32, MemTag::grads);
    solo = parallel::make_solo_communicator();
    sync = std::make_unique<parallel::GradientSync>(offsets, grads, *solo, bo);
  } else if (cfg.parallel.grad_dtype != "fp32") {
    comm = Tensor::empty(*pool, model->grads().shape(), parse_dtype(cfg.parallel.grad_dtype), MemTag::comm);
  }
  Tensor x = Tensor::zeros(*pool, {b, sample[0], sample[1], sample[2]}, DType::f32, MemTag::other);
  Tensor y = Tensor::zeros(*pool, {b}, DType::i32, MemTag::other);
  auto& be = ops::backend_for(pool->device());
  auto step = [&] {
    nn::Context ctx(*pool, be, true);
    ctx.act_dtype = dt;
    ctx.bn_frozen = cfg.model.freeze_bn;
    Tensor d;
    if (sync) {
      sync->begin(true);
      ctx.on_grads_needed = [&](int first, int count) { sync->prepare(first, count); };
      ctx.on_grads_ready = [&](int first, int count) { sync->ready(first, count); };
    }
    nn::forward_and_loss(ctx, *model, x, y, 1.f / b, d);  // as the replica step does it
    model->backward(ctx, d);
    if (sync) sync->finish();
    opt->step(model->params(), grads, 0.f);
  };
  if (gpu) step();
  pool->reset_peaks();
  step();
  auto s = pool->stats();
  Measured m;
  for (int t = 0; t < kNumTags; ++t) m.tags[t] = static_cast<double>(s.tags[t].peak_in_use);
  m.tags[static_cast<int>(MemTag::other)] = 0;  // the measurement's own input batch; counted below
  m.peak = static_cast<double>(s.peak_in_use) - static_cast<double>(x.nbytes() + y.nbytes());
  m.reserved = static_cast<double>(s.peak_reserved);
  return m;
}

}  // namespace

MemPlan plan_memory(const RunConfig& cfg, int64_t micro) {
  auto devices = parse_devices(cfg.parallel.devices);
  const int R = static_cast<int>(devices.size());
  auto ds = make_dataset(cfg.data, "test");  // shape and classes only
  const Shape sample = ds->sample_shape();
  const int64_t classes = ds->classes();
  if (micro <= 0) micro = cfg.train.micro_batch > 0 ? cfg.train.micro_batch : std::max<int64_t>(1, cfg.train.global_batch / R);
  // Two small sizes: above the batch where convolution chunks stop growing for small images.
  const int64_t b1 = std::min<int64_t>(micro, 8), b2 = 2 * b1;
  // Measured on the replicas' device kind: a GPU's kernels (cuDNN workspaces, 16-bit filter
  // gradients) take other memory than the CPU's.
  Measured m1 = measure(cfg, sample, classes, b1, devices[0], R), m2 = measure(cfg, sample, classes, b2, devices[0], R);
  auto at = [&](double v1, double v2, double b) { return v1 + (v2 - v1) / static_cast<double>(b2 - b1) * (b - b1); };
  const double input_per_sample = static_cast<double>(sample.numel() * 4 + 4);
  const int prefetch = cfg.data.prefetch;

  MemPlan p;
  p.micro_batch = micro;
  p.replicas = R;
  p.shard = cfg.parallel.shard;
  p.masters_sharded = cfg.parallel.shard != "none" && parse_dtype(cfg.train.precision) != DType::f32;
  for (int t = 0; t < kNumTags; ++t) p.tag_bytes[t] = at(m1.tags[t], m2.tags[t], static_cast<double>(micro));
  // Inputs in the replica's pool: the current and prefetched batches on a CPU; on a GPU the
  // loader's batches wait in pinned host memory and the device holds the stager's two slots.
  const int input_batches = devices[0].kind == DeviceKind::cuda ? 2 : prefetch + 1;
  p.inputs_bytes = input_per_sample * micro * input_batches;
  auto peak_at = [&](double b) { return at(m1.peak, m2.peak, b) + input_per_sample * b * input_batches; };
  p.peak_bytes = peak_at(static_cast<double>(micro));
  p.overhead_bytes = std::max(0.0, at(m1.reserved - m1.peak, m2.reserved - m2.peak, static_cast<double>(micro)));

  const PoolOptions po = pool_options(cfg.memory, devices[0].kind);
  const size_t total =
      devices[0].kind == DeviceKind::cpu ? host_physical_memory() : cuda_devices().at(devices[0].index).total_memory;
  p.capacity = pool_capacity(po, total, devices[0].str());
  std::ostringstream pd;
  pd << allocator_mode_name(po.mode) << " " << format_bytes(p.capacity) << " on " << devices[0].str();
  p.pool = pd.str();
  // A growing pool is limited in what it reserves, regions included; the others in what is in use.
  if (po.mode != AllocatorMode::growth) p.overhead_bytes = 0;
  p.fits = p.peak_bytes + p.overhead_bytes <= static_cast<double>(p.capacity);
  // Largest micro-batch under the capacity (linear, so solve it), then the largest that divides.
  const double per = peak_at(2) - peak_at(1), base = peak_at(0);
  p.peak_base = base;
  p.peak_per_sample = per;
  p.max_micro_batch = per > 0 ? static_cast<int64_t>(std::floor((static_cast<double>(p.capacity) - base) / per)) : micro;
  p.max_micro_batch = std::max<int64_t>(0, p.max_micro_batch);
  const int64_t per_replica = cfg.train.global_batch / R;
  for (int64_t b = std::min(p.max_micro_batch, per_replica); b >= 1; --b)
    if (per_replica % b == 0 && cfg.train.global_batch % R == 0) {
      p.best_micro_batch = b;
      p.accumulation = static_cast<int>(per_replica / b);
      break;
    }
  return p;
}

std::string MemPlan::report() const {
  std::ostringstream os;
  auto mib = [](double b) {
    char s[32];
    std::snprintf(s, sizeof s, "%10.1f MiB", b / 1048576.0);
    return std::string(s);
  };
  os << "per replica (" << replicas << " replica" << (replicas > 1 ? "s" : "") << "), micro-batch " << micro_batch;
  if (shard != "none")
    os << ", parallel.shard " << shard << " (optimizer state"
       << (masters_sharded ? " and fp32 masters beside the 16-bit copy" : "") << ": the largest of " << replicas
       << " shards"
       << (shard == "gradients" ? "; gradients: that shard kept, a bucket held from backward reaching it until the "
                                  "next one is complete (its reduce-scatter overlapping that one; a slower link holds "
                                  "more)"
                                : "")
       << ")";
  os << ":\n";
  for (int t = 0; t < kNumTags; ++t) {
    if (static_cast<MemTag>(t) == MemTag::other || static_cast<MemTag>(t) == MemTag::data) continue;
    os << "  " << mem_tag_name(static_cast<MemTag>(t)) << std::string(12 - std::string(mem_tag_name(static_cast<MemTag>(t))).size(), ' ')
       << mib(tag_bytes[t]) << " (peak)\n";
  }
  os << "  inputs      " << mib(inputs_bytes) << " (batches waiting in the pool: current + prefetched; a GPU's two staging slots)\n";
  if (overhead_bytes > 0) os << "  pool slack  " << mib(overhead_bytes) << " (growth regions reserved beyond in use)\n";
  os << "  peak        " << mib(peak_bytes) << " in use at once (tags peak at different moments)\n";
  os << "pool: " << pool << "\n";
  if (fits) {
    char s[128];
    std::snprintf(s, sizeof s, "verdict: fits, %.1f%% of the pool, %s to spare\n", 100.0 * peak_bytes / capacity,
                  format_bytes(static_cast<size_t>(capacity - peak_bytes)).c_str());
    os << s;
  } else {
    // What fits is judged on in-use plus a growing pool's regions (fits above): say which is over.
    const double need = peak_bytes + overhead_bytes;
    os << "verdict: does NOT fit: " << format_bytes(static_cast<size_t>(need - static_cast<double>(capacity))) << " over";
    if (overhead_bytes > 0 && peak_bytes <= static_cast<double>(capacity))
      os << " (in use fits; the growth pool's doubling regions do not: memory.mode: preallocate, or a larger pool)";
    os << "\n";
  }
  os << "largest micro-batch that fits: " << max_micro_batch;
  if (best_micro_batch)
    os << "; use micro_batch " << best_micro_batch << " with " << accumulation
       << " accumulation step(s) to keep the global batch";
  else
    os << "; not even 1 fits: lower the model size, use fp16/bf16, or a larger memory.fraction";
  os << "\n";
  return os.str();
}

}  // namespace replica::train
