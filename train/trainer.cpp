// Trainer implementation: set-up (data, devices, pools, models, batch arithmetic, schedule), the
// per-replica fit loop, evaluation, progress and the run directory.
#include "train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <cstring>
#include <sstream>

#include "core/alloc_trace.h"
#include "core/env.h"
#include "core/errors.h"
#include "core/file_io.h"
#include "core/log.h"
#include "core/pools.h"
#include "ops/cpu/threads.h"
#include "ops/models/resnet.h"
#include "train/checkpoint.h"
#include "train/memplan.h"
#include "train/model_io.h"
#include "train/signals.h"
#include "train/tensorboard.h"

namespace replica::train {

using Clock = std::chrono::steady_clock;

std::shared_ptr<data::Dataset> make_dataset(const DataConfig& d, const std::string& split) {
  std::shared_ptr<data::Dataset> ds;
  if (d.dataset == "fashion-mnist" || d.dataset == "mnist") {
    ds = data::load_mnist_dir(d.path, split, d.dataset);
  } else if (d.dataset == "cifar10") {
    ds = data::load_cifar10_dir(d.path, split);
  } else {
    auto& s = d.synthetic_shape;
    int64_t n = split == "train" ? d.synthetic_size : std::max<int64_t>(1, d.synthetic_size / 10);
    ds = std::make_shared<data::SyntheticDataset>(Shape{s[0], s[1], s[2]}, d.synthetic_classes, n,
                                                  split == "train" ? 1 : 2);
  }
  int64_t limit = split == "train" ? d.limit_train : d.limit_test;
  if (limit > 0 && limit < ds->size()) ds = std::make_shared<data::SubsetDataset>(ds, limit);
  return ds;
}

namespace {

std::string json_num(double v) {
  if (!std::isfinite(v)) return "null";
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

PoolOptions pool_options(const MemoryConfig& m, DeviceKind kind) {
  PoolOptions o = default_pool_options(kind);  // device default, then REPLICA_* environment
  if (m.mode) {
    o.mode = parse_allocator_mode(*m.mode, "memory.mode");
    o.mode_source = "memory.mode";
  }
  if (m.fraction) {
    o.fraction = *m.fraction;
    o.fraction_source = "memory.fraction";
  }
  if (m.bytes) o.bytes = *m.bytes;
  return o;
}

}  // namespace

Trainer::Trainer(RunConfig cfg, TrainerOptions opts) : cfg_(std::move(cfg)), opts_(std::move(opts)) {
  auto devices = parse_devices(cfg_.parallel.devices);
  parallel::GroupOptions go;
  go.cpu_pool = pool_options(cfg_.memory, DeviceKind::cpu);
  go.cuda_pool = pool_options(cfg_.memory, DeviceKind::cuda);
  go.comm_timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg_.parallel.timeout_s * 1000));
  // A replica with several intra-op threads must not be pinned to a single core.
  go.pin_threads = cfg_.parallel.pin_threads && cfg_.parallel.intra_op_threads == 1;
  group_ = std::make_unique<parallel::ReplicaGroup>(devices, go);
  if (!group_->lead_process()) opts_.print = false;  // under MPI, global rank 0's process speaks
  const int R = group_->world();  // all replicas of all processes
  const int64_t B = cfg_.train.global_batch;
  if (cfg_.train.micro_batch < 0) {  // auto: the largest micro-batch the pool holds
    MemPlan plan = plan_memory(cfg_);
    if (!plan.best_micro_batch)
      throw ConfigError("train.micro_batch: auto: not even a micro-batch of 1 fits in the pool (" + plan.pool +
                        "); use fp16/bf16, a smaller model or a larger memory.fraction");
    cfg_.train.micro_batch = plan.best_micro_batch;
    if (opts_.print)
      std::printf("replica: micro_batch auto: %ld fits (largest %ld; predicted peak %.1f MiB of %s), %d accumulation step(s)\n",
                  (long)plan.best_micro_batch, (long)plan.max_micro_batch,
                  plan.peak_for(plan.best_micro_batch) / 1048576.0, plan.pool.c_str(), plan.accumulation);
  }
  micro_ = cfg_.train.micro_batch ? cfg_.train.micro_batch : B / R;
  if (micro_ < 1 || B % (micro_ * R) != 0)
    throw ConfigError("train.global_batch " + std::to_string(B) + " is not micro_batch " + std::to_string(micro_) +
                      " x accumulation steps x " + std::to_string(R) +
                      " replicas for any whole number of accumulation steps; pick a global batch divisible by "
                      "micro_batch x replicas (" + std::to_string(std::max<int64_t>(micro_, 1) * R) + ")");
  accumulation_ = static_cast<int>(B / (micro_ * R));

  train_ = make_dataset(cfg_.data, "train");
  test_ = make_dataset(cfg_.data, "test");
  const Shape s = train_->sample_shape();
  if (!cfg_.data.mean.empty() && static_cast<int64_t>(cfg_.data.mean.size()) != s[2])
    throw ConfigError(cfg_.source + ": data.mean has " + std::to_string(cfg_.data.mean.size()) + " values but " +
                      train_->name() + " images have " + std::to_string(s[2]) + " channel(s)");
  aug_ = {cfg_.data.pad_crop, cfg_.data.hflip, cfg_.data.mean, cfg_.data.std};
  sharding_ = std::make_unique<data::Sharding>(train_->size(), micro_, accumulation_, R, cfg_.train.seed, true);

  const int64_t spe = sharding_->steps_per_epoch();
  total_steps_ = std::max<int64_t>(1, std::llround(cfg_.train.epochs * spe));
  if (cfg_.train.max_steps) total_steps_ = std::min(total_steps_, cfg_.train.max_steps);
  sched_.kind = cfg_.optim.schedule;
  sched_.base_lr = static_cast<float>(cfg_.optim.scale_lr ? optim::scaled_lr(cfg_.optim.lr, B) : cfg_.optim.lr);
  sched_.warmup_steps = std::llround(cfg_.optim.warmup_epochs * spe);
  sched_.warmup_start_factor = static_cast<float>(cfg_.optim.warmup_start_factor);
  sched_.total_steps = std::max<int64_t>(1, std::llround(cfg_.train.epochs * spe));
  sched_.min_lr = static_cast<float>(cfg_.optim.min_lr);
  sched_.gamma = static_cast<float>(cfg_.optim.gamma);
  for (double m : cfg_.optim.milestones) sched_.milestones.push_back(std::llround(m * spe));
  optim::validate(sched_);

  models::ResNetConfig mc{.arch = cfg_.model.arch, .in_channels = s[2], .num_classes = train_->classes(),
                          .height = s[0], .width = s[1], .base_width = cfg_.model.width,
                          .zero_init_residual = cfg_.model.zero_init_residual,
                          .checkpoint_every = cfg_.model.checkpoint_every};
  const DType compute = parse_dtype(cfg_.train.precision);
  if (!opts_.trace.empty()) {
    timeline_ = std::make_unique<Timeline>();
    for (int i = 0; i < group_->size(); ++i) {
      const int r = group_->replica(i).rank();
      timeline_->name_track(2 * r, "replica " + std::to_string(r) + " compute");
      timeline_->name_track(2 * r + 1, "replica " + std::to_string(r) + " communication");
    }
  }
  if (!opts_.alloc_trace.empty() && group_->lead_process()) {
    alloc_trace_ = std::make_unique<AllocTrace>();
    group_->replica(0).pool().set_trace(alloc_trace_.get());
  }
  states_.resize(group_->size());
  group_->run([&](parallel::Replica& rep) {
    auto& st = states_[rep.local_index()];
    if (rep.device().kind == DeviceKind::cpu) ops::set_intra_op_threads(cfg_.parallel.intra_op_threads);
    st.model = models::make_resnet(mc);
    st.model->materialize(rep.pool(), cfg_.train.seed, compute);
    // Same seed everywhere already; the broadcast makes "rank 0's weights" a guarantee.
    parallel::broadcast_from_root(rep.comm(), st.model->params());
    parallel::broadcast_from_root(rep.comm(), st.model->buffers());
    const auto& oc = cfg_.optim;
    if (oc.name == "adamw") {
      st.opt = std::make_unique<optim::AdamW>(
          st.model->registry(), st.model->num_params(), rep.pool(),
          optim::AdamWOptions{static_cast<float>(oc.beta1), static_cast<float>(oc.beta2), static_cast<float>(oc.eps),
                              static_cast<float>(oc.weight_decay), oc.no_decay_bn_bias});
    } else if (oc.name == "lars") {
      st.opt = std::make_unique<optim::Lars>(
          st.model->registry(), st.model->num_params(), rep.pool(),
          optim::LarsOptions{static_cast<float>(oc.momentum), static_cast<float>(oc.weight_decay),
                             static_cast<float>(oc.trust_coefficient)});
    } else {
      optim::SgdOptions so{.momentum = static_cast<float>(oc.momentum),
                           .nesterov = oc.nesterov,
                           .weight_decay = static_cast<float>(oc.weight_decay),
                           .decoupled = oc.decoupled_weight_decay,
                           .no_decay_bn_bias = oc.no_decay_bn_bias};
      st.opt = std::make_unique<optim::Sgd>(st.model->registry(), st.model->num_params(), rep.pool(), so);
    }
    const auto& tc = cfg_.train;
    const bool scale = tc.loss_scale == "dynamic" || (tc.loss_scale == "auto" && tc.precision == "fp16") ||
                       (tc.loss_scale != "auto" && tc.loss_scale != "off" && tc.loss_scale != "dynamic");
    if (scale) {
      optim::LossScalerOptions lo;
      lo.dynamic = tc.loss_scale == "dynamic" || tc.loss_scale == "auto";
      lo.init_scale = static_cast<float>(lo.dynamic ? tc.loss_scale_init : std::stod(tc.loss_scale));
      lo.growth_interval = tc.loss_scale_growth_interval;
      lo.min_scale = static_cast<float>(tc.loss_scale_min);
      lo.hysteresis = static_cast<int>(tc.loss_scale_hysteresis);
      lo.max_floor_overflows = tc.loss_scale_max_floor_overflows;
      st.scaler = std::make_unique<optim::DynamicLossScaler>(lo);
    }
    StepOptions so;
    so.accumulation = accumulation_;
    so.micro_batch = micro_;
    so.sync_bn = cfg_.parallel.sync_bn;
    so.bn_frozen = cfg_.model.freeze_bn;
    so.activations = compute;
    so.scaler = st.scaler.get();
    so.clip_grad_norm = oc.clip_grad_norm;
    so.buckets = {cfg_.parallel.bucket_mb, cfg_.parallel.first_bucket_mb, parse_dtype(cfg_.parallel.grad_dtype), &rep.pool()};
    so.timeline = timeline_.get();
    st.step = std::make_unique<ReplicaStep>(rep, *st.model, *st.opt, so);
    st.staging = make_staging_pool(rep.device());
    // A GPU replica's host cores are free: its loader uses a share of them.
    const int workers = rep.device().kind == DeviceKind::cuda
                            ? std::max(1, std::min(8, host_core_count() / std::max(1, group_->size()) - 1))
                            : 1;
    st.loader = std::make_unique<data::ReplicaLoader>(*train_, *sharding_, rep.rank(), st.input_pool(rep), aug_,
                                                      cfg_.train.seed, cfg_.data.prefetch, workers);
    Stream* copy = rep.copy_stream();
    if (!copy && env_flag("REPLICA_STAGE_AHEAD")) {  // the GPU input order on a CPU replica (tests)
      st.stage_stream = make_stream(rep.device());
      copy = st.stage_stream.get();
    }
    st.inputs = std::make_unique<InputStager>(rep.pool(), copy, &rep.stream());
  });
  if (!opts_.resume.empty()) load_resume_point();
}

std::string Trainer::checkpoint_dir() const {
  return cfg_.checkpoint.dir.empty() ? cfg_.train.run_dir + "/checkpoints" : cfg_.checkpoint.dir;
}


std::string Trainer::save_checkpoint(parallel::Replica& rep, int64_t global_step, int64_t epoch, int64_t step_in_epoch) {
  // Every replica's batch-norm statistics, gathered to all (they live in other processes under MPI).
  Tensor& mine = states_[rep.local_index()].model->buffers();
  const std::vector<float> all_buffers = rep.all_gather(mine.data<float>(), static_cast<size_t>(mine.numel()));
  std::string path;
  if (rep.rank() == 0) {
    auto& st = states_[0];
    Checkpoint c;
    c.sections["config"] = cfg_.resolved;
    c.set_meta({{"global_step", std::to_string(global_step)},
                {"epoch", std::to_string(epoch)},
                {"step_in_epoch", std::to_string(step_in_epoch)},
                {"world", std::to_string(replicas())},
                {"global_batch", std::to_string(cfg_.train.global_batch)},
                {"arch", st.model->name()},
                {"num_params", std::to_string(st.model->num_params())},
                {"num_buffers", std::to_string(st.model->num_buffers())},
                {"precision", cfg_.train.precision},
                {"optimizer", st.opt->name()},
                {"optimizer_steps", std::to_string(st.opt->steps())},
                {"seed", std::to_string(cfg_.train.seed)}});
    c.sections["params"] = tensor_to_bytes(st.model->params());
    const size_t nb = static_cast<size_t>(mine.numel());
    for (int r = 0; r < replicas(); ++r)
      c.sections["buffers." + std::to_string(r)] =
          std::string(reinterpret_cast<const char*>(all_buffers.data() + r * nb), nb * sizeof(float));
    std::string opt;
    for (Tensor* t : st.opt->state()) opt += tensor_to_bytes(*t);
    c.sections["optimizer"] = opt;
    if (st.scaler) {
      auto ss = st.scaler->state();
      c.sections["scaler"] = std::string(reinterpret_cast<const char*>(&ss), sizeof ss);
    }
    path = checkpoint_path(checkpoint_dir(), global_step);
    write_checkpoint(c, path);
    rotate_checkpoints(checkpoint_dir(), cfg_.checkpoint.keep_last);
  }
  rep.comm().barrier();
  return path;
}

namespace {
// What a resume needs from a checkpoint, checked whole before anything is applied: a checkpoint
// that fails any check is skipped (with the reason), never half-loaded.
struct ResumePoint {
  int64_t global_step = 0, epoch = 0, step_in_epoch = 0, optimizer_steps = 0, global_batch = 0;
  int world = 0;
};

ResumePoint check_resume_point(const Checkpoint& ck, const std::string& file, nn::Model& model,
                               optim::Optimizer& opt, const optim::DynamicLossScaler* scaler, int64_t steps_per_epoch) {
  constexpr int64_t kBig = int64_t(1) << 53;
  ResumePoint p;
  auto in = [&](const std::string& what) { return file + ": " + what; };
  try {
    const int64_t num_params = ck.meta_int("num_params", 0, kBig);
    if (ck.meta_value("arch") != model.name() || num_params != model.num_params())
      throw IoError("section 'meta': holds a " + ck.meta_value("arch") + " with " + std::to_string(num_params) +
                    " parameters but the configuration builds a " + model.name() + " with " +
                    std::to_string(model.num_params()));
    p.global_step = ck.meta_int("global_step", 0, kBig);
    p.epoch = ck.meta_int("epoch", 0, kBig);
    p.step_in_epoch = ck.meta_int("step_in_epoch", 0, std::max<int64_t>(0, steps_per_epoch - 1));
    p.optimizer_steps = ck.meta_int("optimizer_steps", 0, p.global_step);
    p.global_batch = ck.meta_int("global_batch", 1, kBig);
    p.world = static_cast<int>(ck.meta_int("world", 1, 1 << 20));
  } catch (const IoError& e) {
    std::string m = e.what();
    if (m.rfind("checkpoint: ", 0) == 0) m = m.substr(12);
    throw IoError(in(m));
  }
  const size_t pbytes = model.params().nbytes(), bbytes = model.buffers().nbytes();
  if (ck.sections.at("params").size() != pbytes)
    throw IoError(in("section 'params' holds " + std::to_string(ck.sections.at("params").size()) +
                     " bytes, the model needs " + std::to_string(pbytes) + " (another model or width?)"));
  for (int r = 0; r < p.world; ++r) {
    const std::string name = "buffers." + std::to_string(r);
    auto it = ck.sections.find(name);
    if (it == ck.sections.end())
      throw IoError(in("section '" + name + "' is missing (the checkpoint ran on " + std::to_string(p.world) +
                       " replicas)"));
    if (it->second.size() != bbytes)
      throw IoError(in("section '" + name + "' holds " + std::to_string(it->second.size()) + " bytes, the model needs " +
                       std::to_string(bbytes)));
  }
  size_t need = 0;
  for (Tensor* t : opt.state()) need += t->nbytes();
  auto o = ck.sections.find("optimizer");
  const size_t have = o == ck.sections.end() ? 0 : o->second.size();
  if (ck.meta_value("optimizer") != opt.name() || have != need)
    throw ConfigError("--resume " + file + ": the checkpoint's optimizer is " + ck.meta_value("optimizer") + " (" +
                      std::to_string(have) + " bytes of state), the configuration's " + opt.name() + " (" +
                      std::to_string(need) + "); keep optim.name to resume");
  if (scaler) {
    auto sc = ck.sections.find("scaler");
    if (sc != ck.sections.end()) {
      optim::DynamicLossScaler::State ss;
      if (sc->second.size() != sizeof ss)
        throw IoError(in("section 'scaler' holds " + std::to_string(sc->second.size()) + " bytes, expected " +
                         std::to_string(sizeof ss)));
      std::memcpy(&ss, sc->second.data(), sizeof ss);
      if (!std::isfinite(ss.scale) || ss.scale <= 0 || ss.good < 0 || ss.skipped < 0)
        throw IoError(in("section 'scaler' holds an impossible state (scale " + std::to_string(ss.scale) + ")"));
    }
  }
  return p;
}
}  // namespace

void Trainer::load_resume_point() {
  std::vector<std::string> candidates;
  const std::string& where = opts_.resume;
  if (std::filesystem::is_regular_file(where)) {
    candidates.push_back(where);
  } else {
    candidates = list_checkpoints(where + "/checkpoints");
    if (candidates.empty()) candidates = list_checkpoints(where);
  }
  if (candidates.empty())
    throw ConfigError("--resume " + where + ": no checkpoints (step-*.ckpt) in " + where + "/checkpoints");
  Checkpoint ck;
  ResumePoint at;
  std::string used, reasons;
  for (auto& c : candidates) {
    try {
      ck = read_checkpoint(c);
      at = check_resume_point(ck, c, *states_[0].model, *states_[0].opt, states_[0].scaler.get(),
                              sharding_->steps_per_epoch());
      used = c;
      break;
    } catch (const IoError& e) {
      log_warn("skipping checkpoint ", c, ": ", e.what(), candidates.back() == c ? "" : "; trying the previous one");
      reasons += std::string("\n  ") + e.what();
    }
  }
  if (used.empty()) throw IoError("--resume " + where + ": no valid checkpoint:" + reasons);
  if (at.global_batch != cfg_.train.global_batch)
    throw ConfigError("--resume: the checkpoint was trained with global batch " + std::to_string(at.global_batch) +
                      " but the configuration says " + std::to_string(cfg_.train.global_batch) +
                      "; keep train.global_batch (the data position and the schedule depend on it)");
  const int old_world = at.world;
  group_->run([&](parallel::Replica& rep) {
    auto& st = states_[rep.local_index()];
    tensor_from_bytes(st.model->params(), ck.sections.at("params").data(), st.model->params().nbytes());
    Tensor& b = st.model->buffers();
    if (old_world == replicas()) {
      const std::string& mine = ck.sections.at("buffers." + std::to_string(rep.rank()));
      tensor_from_bytes(b, mine.data(), mine.size());
    } else {  // another replica count: every replica starts from the average statistics
      std::vector<double> acc(static_cast<size_t>(b.numel()), 0.0);
      std::vector<float> f(acc.size());
      for (int r = 0; r < old_world; ++r) {
        std::memcpy(f.data(), ck.sections.at("buffers." + std::to_string(r)).data(), f.size() * sizeof(float));
        for (size_t i = 0; i < acc.size(); ++i) acc[i] += f[i];
      }
      for (size_t i = 0; i < acc.size(); ++i) f[i] = static_cast<float>(acc[i] / old_world);
      tensor_from_bytes(b, f.data(), f.size() * sizeof(float));
    }
    st.model->refresh_compute_copy();
    const std::string& opt = ck.sections.at("optimizer");
    size_t off = 0;
    for (Tensor* t : st.opt->state()) {
      tensor_from_bytes(*t, opt.data() + off, t->nbytes());
      off += t->nbytes();
    }
    st.opt->set_steps(at.optimizer_steps);
    if (st.scaler && ck.sections.count("scaler")) {
      optim::DynamicLossScaler::State ss;
      std::memcpy(&ss, ck.sections.at("scaler").data(), sizeof ss);
      st.scaler->restore(ss);
    }
  });
  start_global_step_ = at.global_step;
  start_epoch_ = at.epoch;
  start_step_in_epoch_ = at.step_in_epoch;
  resumed_from_ = used;
  if (opts_.print) {
    std::printf("replica: resumed from %s at step %ld (epoch %ld, step %ld of it)\n", used.c_str(),
                (long)start_global_step_, (long)start_epoch_ + 1, (long)start_step_in_epoch_);
    if (old_world != replicas())
      std::printf("replica: the checkpoint ran on %d replica(s), this run on %d: %d accumulation step(s) of %ld keep the "
                  "global batch of %ld\n",
                  old_world, replicas(), accumulation_, (long)micro_, (long)cfg_.train.global_batch);
  }
}

Trainer::~Trainer() {
  for (auto& s : states_) {
    s.loader.reset();  // stop prefetch threads before pools go
    s.inputs.reset();
    s.stage_stream.reset();
  }
}

void Trainer::log_line(const std::string& json) {
  if (metrics_path_.empty()) return;
  std::ofstream out(metrics_path_, std::ios::app);
  out << json << '\n';
}

namespace {
// Runs fn() with this replica's batch-norm running statistics replaced by their average over the
// replicas (each saw its own shard; evaluation and the model file use the average, the same on
// every replica), then puts the replica's own statistics back: evaluating or saving never
// changes the training state, so a resumed run and a straight one stay byte-identical.
template <class F>
auto with_averaged_statistics(parallel::Replica& rep, nn::Model& model, F&& fn) {
  Tensor& b = model.buffers();
  if (rep.world() == 1) return fn();
  const std::string own = tensor_to_bytes(b);
  rep.pmean(b.data<float>(), static_cast<size_t>(b.numel()));
  struct Restore {
    const Tensor& b;
    const std::string& own;
    ~Restore() { tensor_from_bytes(b, own.data(), own.size()); }
  } restore{b, own};
  return fn();
}
}  // namespace

EvalResult Trainer::evaluate_on(parallel::Replica& rep) {
  auto& st = states_[rep.local_index()];
  return with_averaged_statistics(rep, *st.model, [&] { return evaluate_averaged(rep); });
}

EvalResult Trainer::evaluate_averaged(parallel::Replica& rep) {
  auto& st = states_[rep.local_index()];
  const int R = rep.world();
  const int64_t eb = cfg_.train.eval_batch, N = test_->size();
  const Shape s = test_->sample_shape();
  double sums[3] = {0, 0, 0};
  for (int64_t j = 0; j * eb * R < N; ++j) {
    const int64_t lo = (j * R + rep.rank()) * eb, hi = std::min(N, lo + eb);
    if (lo >= hi) continue;
    std::vector<int64_t> idx;
    for (int64_t i = lo; i < hi; ++i) idx.push_back(i);
    Tensor x = Tensor::empty(st.input_pool(rep), {hi - lo, s[0], s[1], s[2]}, DType::f32, MemTag::data);
    Tensor y = Tensor::empty(st.input_pool(rep), {hi - lo}, DType::i32, MemTag::data);
    data::load_samples(*test_, idx, aug_, false, cfg_.train.seed, 0, x.data<float>(), y.data<int32_t>());
    auto e = st.step->eval_batch(to_pool(x, rep.pool(), MemTag::data), to_pool(y, rep.pool(), MemTag::data));
    sums[0] += e.loss_sum;
    sums[1] += e.correct;
    sums[2] += e.count;
  }
  float f[3] = {static_cast<float>(sums[0]), static_cast<float>(sums[1]), static_cast<float>(sums[2])};
  if (R > 1) rep.psum(f, 3);
  return {f[0] / f[2], f[1] / f[2], static_cast<int64_t>(f[2])};
}

EvalResult Trainer::evaluate() {
  EvalResult r;
  group_->run([&](parallel::Replica& rep) {
    auto e = evaluate_on(rep);
    if (rep.rank() == 0) r = e;
  });
  return r;
}

FitResult Trainer::fit() {
  const int R = replicas();
  const int64_t spe = sharding_->steps_per_epoch();
  const int64_t epochs = (total_steps_ + spe - 1) / spe;
  const bool tty = opts_.print && isatty(STDOUT_FILENO);
  std::string run_dir = cfg_.train.run_dir;
  std::unique_ptr<TensorBoardWriter> tb;
  std::unique_ptr<DirectoryLock> run_lock;
  if (group_->lead_process()) {  // only global rank 0's process writes the run directory
    std::filesystem::create_directories(run_dir);
    // One writer per run directory: a second `replica train` on it is refused, naming this PID.
    run_lock = std::make_unique<DirectoryLock>(run_dir, "a replica train writing this run directory");
    // Temporaries of a writer killed mid-write (write_file_atomic) are removed, not left to pile up.
    for (const std::string& dir : {run_dir, checkpoint_dir()})
      for (const std::string& f : remove_stale_temporaries(dir)) log_info("removed ", f, " (left by a killed writer)");
    write_file_atomic(run_dir + "/config.yaml", cfg_.resolved);
    metrics_path_ = run_dir + "/metrics.jsonl";
    // A resumed run appends to its metrics; a fresh one starts them anew.
    if (resumed_from_.empty()) std::ofstream(metrics_path_, std::ios::trunc).close();
    if (cfg_.train.tensorboard) tb = std::make_unique<TensorBoardWriter>(run_dir);
  }
  if (opts_.print) {
    std::vector<Device> local;  // what parallel.devices (e.g. auto) resolved to in this process
    for (int i = 0; i < group_->size(); ++i) local.push_back(group_->replica(i).device());
    std::printf("replica: %s on %s (%d replica%s, %s), %s\n", states_[0].model->summary().c_str(),
                devices_str(local).c_str(), R, R > 1 ? "s" : "",
                group_->replica(0).pool().describe().c_str(),
                train_->name().c_str());
    std::printf("replica: global batch %ld = micro-batch %ld x %d accumulation step%s x %d replica%s; %ld steps "
                "(%ld per epoch); %s lr %.4g %s; %s\n",
                (long)cfg_.train.global_batch, (long)micro_, accumulation_, accumulation_ > 1 ? "s" : "", R,
                R > 1 ? "s" : "", (long)total_steps_, (long)spe, cfg_.optim.name.c_str(), sched_.base_lr,
                sched_.kind.c_str(),
                cfg_.train.precision == "fp32"
                    ? "fp32"
                    : (cfg_.train.precision + " activations, fp32 master weights" +
                       (states_[0].scaler ? std::string(", loss scale ") + std::to_string((int64_t)states_[0].scaler->scale()) +
                                                (states_[0].scaler->options().dynamic ? " (dynamic)" : " (static)")
                                          : std::string(", no loss scaling")))
                          .c_str());
    std::fflush(stdout);
  }
  FitResult result;
  auto t_start = Clock::now();
  double train_seconds = 0;
  try {
  group_->run([&](parallel::Replica& rep) {
    auto& st = states_[rep.local_index()];
    const bool lead = rep.rank() == 0;
    int64_t global_step = start_global_step_;
    int64_t last_saved = -1;
    bool stop = false;
    auto t_window = Clock::now();
    int64_t window_images = 0;
    double window_loss = 0, window_acc = 0;
    int window_steps = 0;
    for (int64_t epoch = start_epoch_; epoch < epochs && global_step < total_steps_ && !stop; ++epoch) {
      auto t_epoch = Clock::now();
      const int64_t first = epoch == start_epoch_ ? start_step_in_epoch_ : 0;
      st.loader->begin_epoch(epoch, first);
      st.inputs->clear();
      auto next_batch = [&] {
        Timeline::Scope wait(timeline_.get(), 2 * rep.rank(), "data wait", "data");
        return st.loader->next();
      };
      for (int64_t s = first; s < spe && global_step < total_steps_; ++s) {
        rep.pool().set_step(global_step);
        // memory.step_plan: the second step of the run is recorded, later ones are served.
        const int64_t nth = global_step - start_global_step_;
        const bool plan = cfg_.memory.step_plan && rep.device().kind == DeviceKind::cpu;
        if (plan && nth == 1) rep.pool().plan_record_begin();
        if (plan && nth >= 2) rep.pool().plan_step_begin();
        st.step->zero_grad();
        for (int k = 0; k < accumulation_; ++k) {
          if (st.inputs->empty()) st.inputs->push(next_batch());
          auto [images, labels] = st.inputs->front();
          // The next micro-batch of this epoch starts its copy now, overlapping this one's compute.
          const bool more = k + 1 < accumulation_ || (s + 1 < spe && global_step + 1 < total_steps_);
          if (st.inputs->ahead() && more) st.inputs->push(next_batch());
          st.step->micro_step(images, labels, k == accumulation_ - 1);
          st.inputs->pop();
        }
        // The schedule advances with applied steps only: a skipped (overflowing) step leaves it.
        StepStatus status = st.step->apply(optim::lr_at(sched_, st.opt->steps()));
        if (plan && nth == 1) rep.pool().plan_record_end();
        if (plan && nth >= 2) rep.pool().plan_step_end();
        global_step++;
        if (cfg_.parallel.check_every && global_step % cfg_.parallel.check_every == 0)
          parallel::check_replicas_agree(rep.comm(), st.model->params(), global_step);
        // A signal reaches replicas at slightly different moments: agree on it through a sum.
        float stop_vote = stop_requested() ? 1.f : 0.f;
        if (rep.world() > 1) rep.psum(&stop_vote, 1);
        stop = stop_vote > 0;
        const int64_t next_epoch = s + 1 == spe ? epoch + 1 : epoch, next_step = s + 1 == spe ? 0 : s + 1;
        if (stop || (cfg_.checkpoint.every_steps && global_step % cfg_.checkpoint.every_steps == 0)) {
          auto path = save_checkpoint(rep, global_step, next_epoch, next_step);
          last_saved = global_step;
          if (lead) result.last_checkpoint = path;
        }
        if (lead) {
          result.history.push_back(status);
          if (opts_.on_step) opts_.on_step(status);
        }
        if (stop) {
          if (lead) result.stopped_by_signal = true;
          break;
        }
        if (!lead) continue;
        window_images += status.samples;
        window_loss += status.loss;
        window_acc += status.accuracy;
        window_steps++;
        const bool log_now = global_step % cfg_.train.log_every == 0 || global_step == total_steps_;
        if (tty || log_now) {
          double dt = std::chrono::duration<double>(Clock::now() - t_window).count();
          double ips = window_images / std::max(dt, 1e-9);
          auto ps = rep.pool().stats();
          char line[320];
          int len = std::snprintf(line, sizeof line,
                                  "epoch %ld/%ld step %ld/%ld loss %.4f acc %5.1f%% lr %.4g %.0f img/s pool %.0f/%.0f MiB",
                                  (long)epoch + 1, (long)epochs, (long)global_step, (long)total_steps_,
                                  window_loss / window_steps, 100 * window_acc / window_steps, status.lr, ips,
                                  ps.in_use / 1048576.0, ps.peak_in_use / 1048576.0);
          if (st.scaler)
            std::snprintf(line + len, sizeof line - len, " scale %g skipped %ld", st.scaler->scale(),
                          (long)st.scaler->skipped());
          if (opts_.print) {
            if (tty) std::printf("\r%s\033[K%s", line, log_now ? "\n" : "");
            else if (log_now) std::printf("%s\n", line);
            std::fflush(stdout);
          }
          if (log_now) {
            std::ostringstream js;
            js << "{\"kind\":\"step\",\"step\":" << global_step << ",\"epoch\":" << epoch + 1
               << ",\"loss\":" << json_num(window_loss / window_steps)
               << ",\"accuracy\":" << json_num(window_acc / window_steps) << ",\"lr\":" << json_num(status.lr)
               << ",\"scale\":" << json_num(status.scale)
               << ",\"skipped\":" << (st.scaler ? st.scaler->skipped() : 0) << ",\"applied\":" << (status.applied ? "true" : "false")
               << ",\"grad_norm\":" << json_num(status.grad_norm)
               << ",\"img_per_s\":" << json_num(ips) << ",\"data_wait_s\":" << json_num(st.loader->wait_seconds())
               << ",\"pool_in_use_mib\":[";
            // this process's replicas (all of them unless the run spans processes)
            for (int r = 0; r < group_->size(); ++r)
              js << (r ? "," : "") << json_num(group_->replica(r).pool().stats().in_use / 1048576.0);
            js << "],\"pool_peak_mib\":[";
            for (int r = 0; r < group_->size(); ++r)
              js << (r ? "," : "") << json_num(group_->replica(r).pool().stats().peak_in_use / 1048576.0);
            js << "]}";
            log_line(js.str());
            if (tb) {
              tb->scalar("train/loss", static_cast<float>(window_loss / window_steps), global_step);
              tb->scalar("train/accuracy", static_cast<float>(window_acc / window_steps), global_step);
              tb->scalar("train/lr", status.lr, global_step);
              tb->scalar("train/loss_scale", status.scale, global_step);
              tb->scalar("train/images_per_second", static_cast<float>(ips), global_step);
              tb->flush();
            }
            t_window = Clock::now();
            window_images = 0;
            window_loss = window_acc = 0;
            window_steps = 0;
          }
        }
      }
      double epoch_s = std::chrono::duration<double>(Clock::now() - t_epoch).count();
      if (lead) train_seconds += epoch_s;
      if (cfg_.train.eval && !stop) {
        EvalResult e = [&] {
          Timeline::Scope ev(timeline_.get(), 2 * rep.rank(), "evaluation", "eval");
          return evaluate_on(rep);
        }();
        if (lead) {
          result.test = e;
          if (opts_.print) {
            std::printf("epoch %ld: test loss %.4f accuracy %.2f%% (%ld images), epoch took %.1f s\n", (long)epoch + 1,
                        e.loss, 100 * e.accuracy, (long)e.count, epoch_s);
            std::fflush(stdout);
          }
          std::ostringstream js;
          js << "{\"kind\":\"eval\",\"step\":" << global_step << ",\"epoch\":" << epoch + 1
             << ",\"loss\":" << json_num(e.loss) << ",\"accuracy\":" << json_num(e.accuracy) << ",\"count\":" << e.count
             << ",\"epoch_seconds\":" << json_num(epoch_s) << "}";
          log_line(js.str());
          if (tb) {
            tb->scalar("test/loss", static_cast<float>(e.loss), global_step);
            tb->scalar("test/accuracy", static_cast<float>(e.accuracy), global_step);
            tb->flush();
          }
        }
      }
      if (!stop && cfg_.checkpoint.every_epochs && global_step % spe == 0 &&
          (global_step / spe) % cfg_.checkpoint.every_epochs == 0 && last_saved != global_step) {
        auto path = save_checkpoint(rep, global_step, epoch + 1, 0);
        last_saved = global_step;
        if (lead) result.last_checkpoint = path;
      }
    }
    // The final state is a checkpoint too: nothing trained is lost.
    if (last_saved != global_step) {
      const int64_t e = global_step / spe, sie = global_step % spe;
      auto path = save_checkpoint(rep, global_step, e, sie);
      if (lead) result.last_checkpoint = path;
    }
    if (lead) {
      result.steps = global_step;
      result.skipped = st.scaler ? st.scaler->skipped() : 0;
      if (!result.history.empty()) result.last_loss = result.history.back().loss;
    }
    with_averaged_statistics(rep, *st.model, [&] {
      if (lead) save_model(*st.model, st.model->params(), st.model->buffers(), run_dir + "/model.bin");
    });
  });
  } catch (const parallel::ReplicaError& e) {
    std::string msg = e.what();
    if (msg.find("out of memory") == std::string::npos) throw;
    // Add what the planner would do (measured on this configuration, not guessed).
    std::string advice;
    try {
      MemPlan plan = plan_memory(cfg_);
      if (plan.best_micro_batch)
        advice = " The planner (replica memplan) says micro_batch " + std::to_string(plan.best_micro_batch) + " with " +
                 std::to_string(plan.accumulation) + " accumulation step(s) fits this pool and keeps global_batch " +
                 std::to_string(cfg_.train.global_batch) + " (set train.micro_batch: auto to let it choose).";
      else
        advice = " The planner finds no micro-batch that fits this pool: use model.checkpoint: blocks, "
                 "train.precision: fp16 or bf16, or a larger memory.fraction.";
    } catch (const std::exception&) {
    }
    throw parallel::ReplicaError(e.rank(), msg + advice);
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  if (alloc_trace_) {
    group_->replica(0).pool().set_trace(nullptr);
    alloc_trace_->write_csv(opts_.alloc_trace);
    if (opts_.print) std::printf("replica: %zu allocation events of replica 0 written to %s\n", alloc_trace_->events().size(), opts_.alloc_trace.c_str());
  }
  if (timeline_ && group_->lead_process()) {
    timeline_->write_chrome_json(opts_.trace);
    if (opts_.print) std::printf("replica: timeline written to %s (open in https://ui.perfetto.dev)\n", opts_.trace.c_str());
  }
  int64_t images = 0;
  for (auto& h : result.history) images += h.samples;
  result.images_per_second = images / std::max(train_seconds, 1e-9);
  if (opts_.print && cfg_.memory.step_plan) {
    auto ps = group_->replica(0).pool().plan_stats();
    std::printf("replica: step plan on replica 0: %ld step(s) served, %ld diverged%s; arena %s for %s of peak live "
                "(%zu planned allocations, %zu outside the plan)\n",
                (long)ps.steps_served, (long)ps.steps_diverged,
                ps.last_divergence.empty() ? "" : (" (last: " + ps.last_divergence + ")").c_str(),
                format_bytes(ps.arena_bytes).c_str(), format_bytes(ps.recorded_peak).c_str(), ps.planned, ps.unplanned);
  }
  if (opts_.print) {
    if (states_[0].scaler) std::printf("replica: %ld of %ld steps skipped for overflow\n", (long)result.skipped, (long)result.steps);
    std::printf("replica: %ld steps in %.1f s (%.0f img/s training); model saved to %s/model.bin, metrics in %s\n",
                (long)result.steps, result.seconds, result.images_per_second, run_dir.c_str(), metrics_path_.c_str());
    std::fflush(stdout);
  }
  return result;
}

}  // namespace replica::train
