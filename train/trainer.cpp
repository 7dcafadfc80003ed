// Trainer implementation: set-up (data, devices, pools, models, batch arithmetic, schedule) and the
// per-replica fit loop. Evaluation is in trainer_eval.cpp, the run directory, console lines and
// report in trainer_output.cpp, checkpoints in trainer_checkpoints.cpp, a lost replica's recovery
// in recovery.cpp.
#include "train/trainer.h"

#include "train/averaged_statistics.h"

#include "train/weights_interop.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <cstring>
#include <optional>
#include <sstream>

#include "core/alloc_trace.h"
#include "core/env.h"
#include "core/errors.h"
#include "core/file_io.h"
#include "core/log.h"
#include "core/pools.h"
#include "ops/backend.h"
#include "ops/cpu/isa.h"
#include "ops/cpu/threads.h"
#include "ops/cpu/tuning.h"
#include "data/image_pack.h"
#include "ops/models/resnet.h"
#include "train/checkpoint.h"
#include "train/checkpoint_policy.h"
#include "train/factory.h"
#include "train/memory_advice.h"
#include "train/weights_interop.h"
#include "train/metrics_sink.h"
#include "train/memplan.h"
#include "train/model_io.h"
#include "train/signals.h"
#include "train/tensorboard.h"

namespace replica::train {

using Clock = std::chrono::steady_clock;

namespace {
// The image data set behind `ds` (through a data.limit_* subset), or null.
const data::EncodedImageDataset* encoded(const data::Dataset* ds) {
  if (const auto* sub = dynamic_cast<const data::SubsetDataset*>(ds)) ds = &sub->base();
  return dynamic_cast<const data::EncodedImageDataset*>(ds);
}
}  // namespace

// Image folders name their classes: train and val must name the same ones, and the run directory
// keeps the mapping (classes.txt), so a resumed or continued run cannot silently relabel.
void Trainer::check_classes() {
  const auto* tr = encoded(train_.get());
  const auto* va = encoded(test_.get());
  if (!tr || !va) return;
  if (tr->class_names() != va->class_names())
    throw ConfigError("data: the train and val folders name different classes (only in train: " +
                      data::class_difference(tr->class_names(), va->class_names()) + "; only in val: " +
                      data::class_difference(va->class_names(), tr->class_names()) +
                      "); every class needs a folder in both");
  for (const auto& c : tr->class_names()) class_list_ += c + "\n";
  const std::string path = cfg_.train.run_dir + "/classes.txt";
  if (std::filesystem::exists(path) && read_file(path, "class list") != class_list_)
    throw ConfigError(path + ": this run directory was trained on other classes (or another order) than " +
                      cfg_.data.path + " has; use another train.run_dir, or the data set it was trained on");
}

std::shared_ptr<data::Dataset> make_dataset(const DataConfig& d, const std::string& split) {
  std::shared_ptr<data::Dataset> ds;
  if (d.dataset == "folder" || d.dataset == "packed") {
    data::ImageRecipe r;
    r.image_size = static_cast<int>(d.image_size);
    r.eval_resize = static_cast<int>(d.eval_resize);
    r.crop = {d.crop_scale[0], d.crop_scale[1], d.crop_ratio[0], d.crop_ratio[1]};
    r.hflip = d.hflip;
    r.skip_bad_files = d.skip_bad_files;
    const bool train = split == "train";
    const std::string& given = train ? d.train_dir : d.val_dir;
    const std::string base = d.path + (train ? "/train" : "/val");
    if (d.dataset == "folder") ds = std::make_shared<data::FolderDataset>(given.empty() ? base : given, r, "folder:" + split);
    else ds = std::make_shared<data::PackedDataset>(given.empty() ? base + ".pack" : given, r, "packed:" + split);
  } else if (d.dataset == "fashion-mnist" || d.dataset == "mnist") {
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

Trainer::Trainer(RunConfig cfg, TrainerOptions opts) : cfg_(std::move(cfg)), opts_(std::move(opts)) {
  auto devices = parse_devices(cfg_.parallel.devices);
  go_.cpu_pool = pool_options(cfg_.memory, DeviceKind::cpu);
  go_.cuda_pool = pool_options(cfg_.memory, DeviceKind::cuda);
  go_.comm_timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg_.parallel.timeout_s * 1000));
  // A replica with several intra-op threads must not be pinned to a single core.
  go_.pin_threads = cfg_.parallel.pin_threads && cfg_.parallel.intra_op_threads == 1;
  go_.latency_lane = cfg_.parallel.sync_bn;  // sync-BN's reductions get their own NCCL lane
  if (cfg_.parallel.on_replica_failure == "shrink" && cfg_.parallel.min_replicas > static_cast<int64_t>(devices.size()))
    throw ConfigError("parallel.min_replicas " + std::to_string(cfg_.parallel.min_replicas) + " is more than the " +
                      std::to_string(devices.size()) + " device(s) of parallel.devices " + cfg_.parallel.devices +
                      ": a shrinking run could never start; lower parallel.min_replicas");
  if (cfg_.parallel.on_replica_failure == "shrink" && cfg_.parallel.shard != "none")
    throw ConfigError("parallel.on_replica_failure: shrink with parallel.shard: " + cfg_.parallel.shard +
                      ": a lost replica takes its shard of the optimizer state with it, so the survivors could not "
                      "continue from memory; use parallel.shard: none, or on_replica_failure: stop and resume from "
                      "the last checkpoint");
  if (cfg_.train.cuda_graph == "on" && !opts_.record_cpu_steps)
    for (const Device& d : devices)
      if (d.kind != DeviceKind::cuda)
        throw ConfigError("train.cuda_graph: on: CUDA graphs need GPU replicas, and " + d.str() +
                          " is not one; use off, or auto (graphs where they can serve, eager elsewhere)");
  fault_ = FaultInjector::from_env();
  // train.deterministic: one setting per backend (the GPU's cuDNN choices; CPU runs always are).
  const bool deterministic = resolve_deterministic(cfg_.train);
  for (const Device& d : devices)
    if (d.kind == DeviceKind::cuda) ops::backend_for(d).set_deterministic(deterministic);
  // micro_batch: auto is planned before the replica group takes its pools: on a GPU the planner
  // must measure on a device that is not already 75% preallocated.
  std::optional<MemPlan> plan;
  if (cfg_.train.micro_batch < 0) {  // auto: the largest micro-batch the pool holds
    plan = plan_memory(cfg_);
    if (!plan->best_micro_batch)
      throw ConfigError("train.micro_batch: auto: not even a micro-batch of 1 fits in the pool (" + plan->pool +
                        "); use fp16/bf16, a smaller model or a larger memory.fraction");
    cfg_.train.micro_batch = plan->best_micro_batch;
  }
  train_ = make_dataset(cfg_.data, "train");
  test_ = make_dataset(cfg_.data, "test");
  check_classes();
  const Shape s = train_->sample_shape();
  if (!cfg_.data.mean.empty() && static_cast<int64_t>(cfg_.data.mean.size()) != s[2])
    throw ConfigError(cfg_.source + ": data.mean has " + std::to_string(cfg_.data.mean.size()) + " values but " +
                      train_->name() + " images have " + std::to_string(s[2]) + " channel(s)");
  if (devices.at(0).kind == DeviceKind::cpu) {
    // The CPU kernels' per-CPU choice (the direct convolutions' register width), measured once per
    // CPU model on this model's own layers and cached (ops/cpu/tuning.h); after the checks above,
    // so a configuration error comes at once.
    auto probe = make_model(cfg_, s, train_->classes());
    const std::string what = cfg_.model.arch + " " + std::to_string(s[0]) + "x" + std::to_string(s[1]) + "x" +
                             std::to_string(s[2]);
    cpu_tuning_ = ops::tune_cpu_kernels(nn::conv_geometries(probe->root(), {1, s[0], s[1], s[2]}), what).line();
  }
  aug_ = {cfg_.data.pad_crop, cfg_.data.hflip, cfg_.data.mean, cfg_.data.std};
  const auto& d = cfg_.data;
  aug_.mix = {d.mixup_alpha, d.cutmix_alpha, d.mix_prob, d.mix_switch_prob, d.mix_off_epoch};
  aug_.policy = {data::parse_augment_policy(d.augment), static_cast<int>(d.randaugment_ops),
                 static_cast<int>(d.randaugment_magnitude), d.random_erase};
  build(devices);
  if (plan && opts_.print)
    std::printf("replica: micro_batch auto: %ld fits (largest %ld; predicted peak %.1f MiB of %s), %d accumulation step(s)\n",
                (long)plan->best_micro_batch, (long)plan->max_micro_batch,
                plan->peak_for(plan->best_micro_batch) / 1048576.0, plan->pool.c_str(), plan->accumulation);
  if (!opts_.resume.empty()) load_resume_point();
}

// The replica group over `devices` and everything sized by it: the batch split (micro-batch x
// accumulation x replicas = the global batch), the data sharding, the schedule, and each
// replica's model, optimizer and loader. Called once, and again by a shrink on the survivors.
void Trainer::build(const std::vector<Device>& devices) {
  group_ = std::make_unique<parallel::ReplicaGroup>(devices, go_);
  if (!group_->lead_process()) opts_.print = false;  // under MPI, global rank 0's process speaks
  const int R = group_->world();  // all replicas of all processes
  const int64_t B = cfg_.train.global_batch;
  micro_ = cfg_.train.micro_batch ? cfg_.train.micro_batch : B / R;
  if (micro_ < 1 || B % (micro_ * R) != 0)
    throw ConfigError("train.global_batch " + std::to_string(B) + " is not micro_batch " + std::to_string(micro_) +
                      " x accumulation steps x " + std::to_string(R) +
                      " replicas for any whole number of accumulation steps; pick a global batch divisible by "
                      "micro_batch x replicas (" + std::to_string(std::max<int64_t>(micro_, 1) * R) + ")");
  accumulation_ = static_cast<int>(B / (micro_ * R));
  if (aug_.mix.enabled() && micro_ % 2 != 0)
    throw ConfigError("data.mixup_alpha / data.cutmix_alpha mix samples 2k and 2k+1 of a micro-batch, but the "
                      "micro-batch is " + std::to_string(micro_) + " (odd); use an even train.micro_batch, or a "
                      "global batch that splits into even micro-batches over " + std::to_string(R) + " replica(s)");
  sharding_ = std::make_unique<data::Sharding>(train_->size(), micro_, accumulation_, R, cfg_.train.seed, true);
  init_schedule();
  const DType compute = parse_dtype(cfg_.train.precision);
  if (!opts_.trace.empty()) {
    if (!timeline_) timeline_ = std::make_unique<Timeline>();
    for (int i = 0; i < group_->size(); ++i) {
      const int r = group_->replica(i).rank();
      timeline_->name_track(2 * r, "replica " + std::to_string(r) + " compute");
      timeline_->name_track(2 * r + 1, "replica " + std::to_string(r) + " communication");
    }
  }
  if (!opts_.alloc_trace.empty() && group_->lead_process()) {
    if (!alloc_trace_) alloc_trace_ = std::make_unique<AllocTrace>();
    group_->replica(0).pool().set_trace(alloc_trace_.get());
  }
  states_.clear();
  states_.resize(group_->size());
  const Shape s = train_->sample_shape();
  group_->run([&](parallel::Replica& rep) { init_replica(rep, s, compute); });
}

// The step count and the learning-rate schedule, in steps of this run's global batch.
void Trainer::init_schedule() {
  const int64_t spe = sharding_->steps_per_epoch();
  total_steps_ = std::max<int64_t>(1, std::llround(cfg_.train.epochs * spe));
  if (cfg_.train.max_steps) total_steps_ = std::min(total_steps_, cfg_.train.max_steps);
  sched_.kind = cfg_.optim.schedule;
  const auto& o = cfg_.optim;
  sched_.base_lr = static_cast<float>(o.scale_lr ? optim::scaled_lr(o.lr, cfg_.train.global_batch) : o.lr);
  sched_.warmup_steps = std::llround(cfg_.optim.warmup_epochs * spe);
  sched_.warmup_start_factor = static_cast<float>(cfg_.optim.warmup_start_factor);
  sched_.total_steps = std::max<int64_t>(1, std::llround(cfg_.train.epochs * spe));
  sched_.min_lr = static_cast<float>(cfg_.optim.min_lr);
  sched_.power = static_cast<float>(cfg_.optim.poly_power);
  sched_.gamma = static_cast<float>(cfg_.optim.gamma);
  for (double m : cfg_.optim.milestones) sched_.milestones.push_back(std::llround(m * spe));
  optim::validate(sched_);
}

// model.init_from: PyTorch-named weights (a torchvision checkpoint, an export of another run). A
// classifier of another number of classes is left as initialised, and the run says so.
void Trainer::init_from_file(parallel::Replica& rep, nn::Model& model) {
  const std::string& path = cfg_.model.init_from;
  const std::string bytes = read_file(path, "model.init_from");
  const ImportReport r = import_safetensors(model, bytes, path, {.allow_new_classifier = true});
  if (rep.rank() == 0 && opts_.print) {
    std::printf("replica: model.init_from %s: %ld tensors (%s)\n", path.c_str(), static_cast<long>(r.tensors),
                r.dtype.c_str());
    for (const auto& k : r.kept)
      std::printf("replica: model.init_from: %s differs in shape: re-initialised for %ld classes\n", k.c_str(),
                  static_cast<long>(train_->classes()));
  }
}

// One replica's model (rank 0's weights everywhere), optimizer, scaler, step, loader and input
// stager, built on its own thread (its device and stream are current there).
void Trainer::init_replica(parallel::Replica& rep, const Shape& s, DType compute) {
  auto& st = states_[rep.local_index()];
  rep.pool().set_oom_advice(memory_advice);  // an out-of-memory says what to change in the config
  if (rep.device().kind == DeviceKind::cpu) ops::set_intra_op_threads(cfg_.parallel.intra_op_threads);
  st.model = make_model(cfg_, s, train_->classes());
  st.model->materialize(rep.pool(), cfg_.train.seed, compute);
  if (!cfg_.model.init_from.empty()) init_from_file(rep, *st.model);
  // Same seed everywhere already; the broadcast makes "rank 0's weights" a guarantee.
  parallel::broadcast_from_root(rep.comm(), st.model->params());
  parallel::broadcast_from_root(rep.comm(), st.model->buffers());
  // parallel.shard: this replica keeps the optimizer state of its shard only (ZeRO-1/2).
  const parallel::ShardPlan shard = make_shard_plan(cfg_, *st.model, rep.world());
  optim::ShardRange range;
  if (shard.sharded()) range = {shard.lo(rep.rank()), shard.hi(rep.rank())};
  // Beside a 16-bit compute copy the f32 masters are sharded too (they are what the optimizer
  // updates); in f32 the layers read them, so they stay whole.
  if (shard.sharded() && compute != DType::f32) st.model->shard_masters(range.lo, range.hi);
  st.opt = make_optimizer(cfg_.optim, *st.model, rep.pool(), range);
  st.scaler = make_loss_scaler(cfg_.train);
  StepOptions so;
  so.accumulation = accumulation_;
  so.micro_batch = micro_;
  so.sync_bn = cfg_.parallel.sync_bn;
  so.bn_frozen = cfg_.model.freeze_bn;
  so.activations = compute;
  so.scaler = st.scaler.get();
  so.clip_grad_norm = cfg_.optim.clip_grad_norm;
  so.label_smoothing = static_cast<float>(cfg_.train.label_smoothing);
  so.buckets = {cfg_.parallel.bucket_mb, cfg_.parallel.first_bucket_mb, parse_dtype(cfg_.parallel.grad_dtype), &rep.pool()};
  so.timeline = timeline_.get();
  so.shard = shard;
  if (fault_) {
    so.fault = [this, &rep](const char* where) { fault_point(rep, where); };
    so.fault_site = fault_->where;
  }
  so.deterministic = resolve_deterministic(cfg_.train);
  // train.cuda_graph: on where it cannot serve is an error (ReplicaStep says why); auto stays eager.
  so.cuda_graph = cfg_.train.cuda_graph;
  if (so.cuda_graph == "auto") {
    const std::string note = rep.device().kind != DeviceKind::cuda && !opts_.record_cpu_steps
                                 ? "CUDA graphs need a GPU replica"
                                 : cuda_graph_ineligible(so, rep);
    if (!note.empty()) so.cuda_graph = "off";
    // Every replica thread runs this at once: the first one's reason is the run's (they agree).
    if (rep.local_index() == 0) cuda_graph_note_ = note;
  }
  st.step = std::make_unique<ReplicaStep>(rep, *st.model, *st.opt, so);
  st.staging = make_staging_pool(rep.device());
  // A GPU replica's host cores are free: its loader uses a share of them.
  // data.workers, or by default: a GPU replica's share of the host's cores; for image files on CPU
  // replicas, the cores no replica runs on (decoding is the work there); in-memory data: 1.
  int workers = static_cast<int>(cfg_.data.workers);
  if (!workers) {
    const int local = std::max(1, group_->size());
    if (rep.device().kind == DeviceKind::cuda) workers = std::max(1, std::min(8, host_core_count() / local - 1));
    else if (encoded(train_.get())) workers = std::max(1, (host_core_count() - local) / local);
    else workers = 1;
  }
  st.loader = std::make_unique<data::ReplicaLoader>(*train_, *sharding_, rep.rank(), st.input_pool(rep), aug_,
                                                    cfg_.train.seed, cfg_.data.prefetch, workers);
  Stream* copy = rep.copy_stream();
  if (!copy && env_flag("REPLICA_STAGE_AHEAD")) {  // the GPU input order on a CPU replica (tests)
    st.stage_stream = make_stream(rep.device());
    copy = st.stage_stream.get();
  }
  st.inputs = std::make_unique<InputStager>(rep.pool(), copy, &rep.stream());
  // The moving average starts as the model (a resume then loads the checkpoint's).
  if (const EmaOptions eo = ema_options(); eo.on())
    st.ema = std::make_unique<WeightEma>(rep.pool(), st.model->params(), st.model->buffers(), eo);
}

EmaOptions Trainer::ema_options() const {
  return {cfg_.train.ema_decay, cfg_.train.ema_every,
          std::llround(cfg_.train.ema_warmup_epochs * static_cast<double>(sharding_->steps_per_epoch()))};
}

Trainer::~Trainer() {
  for (auto& s : states_) {
    s.loader.reset();  // stop prefetch threads before pools go
    s.inputs.reset();
    s.stage_stream.reset();
  }
}

// ---- the fit loop ---------------------------------------------------------------------------
//
// fit() opens the run directory, runs fit_replica on every replica (pmap style) and reports;
// fit_replica is the loop: per step train_step (micro-steps, all-reduce, update, the stop vote),
// the replica check, checkpoints by the CheckpointPolicy, metrics to the sinks; per epoch the
// evaluation; at the end the final checkpoint and the model file.

FitResult Trainer::fit() {
  const int64_t spe = sharding_->steps_per_epoch();
  const int64_t epochs = (total_steps_ + spe - 1) / spe;
  FitLoop loop{CheckpointPolicy(cfg_.checkpoint, checkpoint_dir(), spe), epochs, {}, {}, 0};
  // "Many steps" above 85%: 50 in a row, or a quarter of a short run (at least 10).
  for (auto& st : states_) st.pressure = MemoryPressure(std::min<int64_t>(50, std::max<int64_t>(10, total_steps_ / 4)));
  std::unique_ptr<DirectoryLock> lock;
  if (group_->lead_process()) lock = open_run_directory(loop.sinks);  // rank 0's process writes it
  print_start();
  const auto t_start = Clock::now();
  for (;;) {
    try {
      group_->run([&](parallel::Replica& rep) { fit_replica(rep, loop); });
      break;
    } catch (const parallel::ReplicaError& e) {
      if (shrink_to_survivors(e, loop)) continue;  // parallel.on_replica_failure: shrink
      if (!e.cause_as<OutOfMemoryError>()) throw;
      throw parallel::ReplicaError(e.rank(), e.what() + planner_advice(), e.cause());
    }
  }
  FitResult& result = loop.result;
  result.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  int64_t images = 0;
  for (auto& h : result.history) images += h.samples;
  result.images_per_second = images / std::max(loop.train_seconds, 1e-9);
  if (group_->lead_process()) loop.sinks.summary(run_report(loop));
  write_traces();
  print_end(result);
  return result;
}

void Trainer::fit_replica(parallel::Replica& rep, FitLoop& loop) {
  auto& st = states_[rep.local_index()];
  const bool lead = rep.rank() == 0;
  const int64_t spe = sharding_->steps_per_epoch();
  int64_t step = start_global_step_;
  bool stop = false;
  StepWindow window;
  CheckpointPolicy checkpoints = loop.checkpoints;  // each replica's own: it records what was saved
  remember_step(rep, step);
  for (int64_t epoch = start_epoch_; epoch < loop.epochs && step < total_steps_ && !stop; ++epoch) {
    const auto t_epoch = Clock::now();
    const int64_t first = epoch == start_epoch_ ? start_step_in_epoch_ : 0;
    st.loader->begin_epoch(epoch, first);
    st.inputs->clear();
    for (int64_t s = first; s < spe && step < total_steps_ && !stop; ++s) {
      const StepStatus status = train_step(rep, step, s + 1 < spe);
      stop = status.stop;
      ++step;
      remember_step(rep, step);
      if (cfg_.parallel.check_every && step % cfg_.parallel.check_every == 0)
        parallel::check_replicas_agree(rep.comm(), st.model->replicated_params(), step);
      // Where the data resumes after this step: the next step of this epoch, or the next epoch.
      if (checkpoints.after_step(step, stop))
        save_checkpoint(rep, loop, checkpoints, step, s + 1 == spe ? epoch + 1 : epoch, s + 1 == spe ? 0 : s + 1);
      if (!lead) continue;
      loop.result.history.push_back(status);
      if (opts_.on_step) opts_.on_step(status);
      if (stop) {
        loop.result.stopped_by_signal = true;
        loop.result.stopped_by = preempt_noticed_ ? "parallel.preempt_file " + cfg_.parallel.preempt_file + " appeared"
                                                  : "signal " + std::to_string(stop_signal());
        break;
      }
      window.add(status);
      const bool logged = step % cfg_.train.log_every == 0 || step == total_steps_;
      if (logged || opts_.print) loop.sinks.step(step_record(rep, window, status, step, epoch), logged);
      if (logged) window.reset();
    }
    const double epoch_seconds = std::chrono::duration<double>(Clock::now() - t_epoch).count();
    if (lead) loop.train_seconds += epoch_seconds;
    std::string first_bad;
    if (const int64_t bad = train_->skipped_files(&first_bad); lead && bad && opts_.print)
      std::printf("replica: data.skip_bad_files: %ld unreadable file(s) replaced so far, the first %s\n",
                  static_cast<long>(bad), first_bad.c_str());
    if (cfg_.train.eval && !stop) {
      const auto t_eval = Clock::now();
      EvalResult e = [&] {
        Timeline::Scope ev(timeline_.get(), 2 * rep.rank(), "evaluation", "eval");
        return evaluate_on(rep);
      }();
      const EvalResult ee = st.ema ? evaluate_ema(rep) : EvalResult{};  // beside the live weights
      if (lead) loop.eval_seconds += std::chrono::duration<double>(Clock::now() - t_eval).count();
      if (lead) {
        loop.result.test = e;
        loop.result.test_ema = ee;
        loop.sinks.eval({.step = step, .epoch = epoch + 1, .count = e.count, .loss = e.loss, .accuracy = e.accuracy,
                         .top5 = e.top5, .epoch_seconds = epoch_seconds, .ema_count = ee.count,
                         .ema_loss = ee.loss, .ema_accuracy = ee.accuracy, .ema_top5 = ee.top5});
      }
    }
    if (!stop && checkpoints.at_epoch_end(step)) save_checkpoint(rep, loop, checkpoints, step, epoch + 1, 0);
  }
  // The final state is a checkpoint too: nothing trained is lost.
  if (checkpoints.at_end(step)) save_checkpoint(rep, loop, checkpoints, step, step / spe, step % spe);
  if (lead) {
    loop.result.steps = step;
    loop.result.skipped = st.scaler ? st.scaler->skipped() : 0;
    if (!loop.result.history.empty()) loop.result.last_loss = loop.result.history.back().loss;
  }
  const auto t_save = Clock::now();
  std::string masters = gather_masters(rep);  // every replica takes part; the lead writes them
  with_averaged_statistics(rep, *st.model, [&] {
    if (!lead) return;
    const Tensor params = Tensor::wrap(masters.data(), {static_cast<int64_t>(masters.size() / sizeof(float))},
                                       DType::f32, Device{});
    save_model(*st.model, params, st.model->buffers(), cfg_.train.run_dir + "/model.bin");
  });
  if (st.ema) save_ema_model(rep);
  if (lead) loop.checkpoint_seconds += std::chrono::duration<double>(Clock::now() - t_save).count();
}

StepStatus Trainer::train_step(parallel::Replica& rep, int64_t global_step, bool more_in_epoch) {
  auto& st = states_[rep.local_index()];
  auto next_batch = [&] {
    Timeline::Scope wait(timeline_.get(), 2 * rep.rank(), "data wait", "data");
    return st.loader->next();
  };
  rep.pool().set_step(global_step);
  rep.pool().push_scope();  // this step's peak, for the memory-pressure rule
  // memory.step_plan: the second step of the run is recorded, later ones are served.
  const int64_t nth = global_step - start_global_step_;
  const bool plan = cfg_.memory.step_plan && rep.device().kind == DeviceKind::cpu;
  if (plan && nth == 1) rep.pool().plan_record_begin();
  if (plan && nth >= 2) rep.pool().plan_step_begin();
  st.running_step = global_step + 1;
  fault_point(rep, "start");
  st.step->zero_grad();
  for (int k = 0; k < accumulation_; ++k) {
    if (st.inputs->empty()) st.inputs->push(next_batch());
    auto [images, labels] = st.inputs->front();
    // The next micro-batch of this epoch starts its copy now, overlapping this one's compute.
    const bool more = k + 1 < accumulation_ || (more_in_epoch && global_step + 1 < total_steps_);
    if (st.inputs->ahead() && more) st.inputs->push(next_batch());
    st.step->micro_step(images, labels, k == accumulation_ - 1);
    st.inputs->pop();
  }
  // The schedule advances with applied steps only: a skipped (overflowing) step leaves it.
  // The stop vote: a signal, or the preemption notice file (any replica seeing it stops them all).
  bool preempted = false;
  if (!cfg_.parallel.preempt_file.empty() && std::filesystem::exists(cfg_.parallel.preempt_file)) {
    preempted = true;
    preempt_noticed_ = true;
  }
  StepStatus status = st.step->apply(optim::lr_at(sched_, st.opt->steps()), stop_requested() || preempted);
  // After the update on the replica's stream: the moving average of what it wrote.
  if (st.ema && status.applied) st.ema->after_step(st.opt->steps(), st.model->params(), st.model->buffers());
  if (plan && nth == 1) rep.pool().plan_record_end();
  if (plan && nth >= 2) rep.pool().plan_step_end();
  const std::string warning = st.pressure.observe(rep.device().str(), rep.pool().pop_scope().peak_in_use / 1048576.0,
                                                  rep.pool().capacity() / 1048576.0,
                                                  rep.pool().options().bytes ? "memory.bytes" : "memory.fraction");
  if (!warning.empty()) log_warn(warning);
  return status;
}

}  // namespace replica::train
