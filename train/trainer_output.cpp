// Trainer: what a run writes and prints: the run directory (its lock, config.yaml, classes.txt and
// the metrics sinks), the first and last lines, each step's record for the sinks, the run report,
// the traces, and the planner's advice added to an out-of-memory error.
#include "train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/file_io.h"
#include "core/log.h"
#include "ops/cpu/isa.h"
#include "train/memplan.h"
#include "train/metrics_sink.h"
#include "train/tensorboard.h"

namespace replica::train {

using Clock = std::chrono::steady_clock;

// The run's summary (train/run_report.h): rank 0's phase times, this process's pools.
RunReport Trainer::run_report(const FitLoop& loop) const {
  RunReport r;
  const auto& st = states_[0];
  r.wall_s = loop.result.seconds;
  r.steps = loop.result.steps;
  for (const auto& h : loop.result.history) r.images += h.samples;
  r.images_per_s = loop.result.images_per_second;
  r.replicas = group_->world();
  r.devices = cfg_.parallel.devices;
  r.data_wait_s = st.loader->wait_seconds();
  r.compute_s = st.step->phases().compute;
  r.allreduce_wait_s = st.step->phases().allreduce_wait;
  r.optimizer_s = st.step->phases().optimizer;
  r.eval_s = loop.eval_seconds;
  r.checkpoint_s = loop.checkpoint_seconds;
  for (int i = 0; i < group_->size(); ++i) {
    const auto s = group_->replica(i).pool().stats();
    r.peak_mib.push_back(s.peak_in_use / 1048576.0);
    r.capacity_mib.push_back(s.capacity / 1048576.0);
  }
  for (const auto& s : states_) r.pressure_steps = std::max(r.pressure_steps, s.pressure.steps_above());
  r.cost_per_device_hour = cfg_.run.cost_per_device_hour;
  const auto tags = group_->replica(0).pool().stats().tags;
  auto mib = [&](MemTag t) { return tags[static_cast<int>(t)].peak_in_use / 1048576.0; };
  r.shard = cfg_.parallel.shard;
  r.params_mib = mib(MemTag::params);
  r.grads_mib = mib(MemTag::grads);
  r.optimizer_mib = mib(MemTag::optimizer);
  r.params_kept_mib = tags[static_cast<int>(MemTag::params)].in_use / 1048576.0;
  r.grads_kept_mib = tags[static_cast<int>(MemTag::grads)].in_use / 1048576.0;
  r.events = events_;
  return r;
}

StepRecord Trainer::step_record(parallel::Replica& rep, const StepWindow& window, const StepStatus& last,
                                int64_t step, int64_t epoch) {
  auto& st = states_[rep.local_index()];
  StepRecord r = window.record(last);
  r.step = step;
  r.total_steps = total_steps_;
  r.epoch = epoch + 1;
  r.epochs = (total_steps_ + sharding_->steps_per_epoch() - 1) / sharding_->steps_per_epoch();
  r.has_scaler = st.scaler != nullptr;
  r.skipped = st.scaler ? st.scaler->skipped() : 0;
  r.data_wait_s = st.loader->wait_seconds();
  const auto ps = rep.pool().stats();
  r.pool_in_use_replica0_mib = ps.in_use / 1048576.0;
  r.pool_peak_replica0_mib = ps.peak_in_use / 1048576.0;
  for (int i = 0; i < group_->size(); ++i) {  // this process's replicas (all, unless the run spans processes)
    const auto s = group_->replica(i).pool().stats();
    r.pool_in_use_mib.push_back(s.in_use / 1048576.0);
    r.pool_peak_mib.push_back(s.peak_in_use / 1048576.0);
  }
  return r;
}

std::unique_ptr<DirectoryLock> Trainer::open_run_directory(MetricsSinks& sinks) {
  const std::string& run_dir = cfg_.train.run_dir;
  std::filesystem::create_directories(run_dir);
  // One writer per run directory: a second `replica train` on it is refused, naming this PID.
  auto lock = std::make_unique<DirectoryLock>(run_dir, "a replica train writing this run directory");
  // Temporaries of a writer killed mid-write (write_file_atomic) are removed, not left to pile up.
  for (const std::string& dir : {run_dir, checkpoint_dir()})
    for (const std::string& f : remove_stale_temporaries(dir)) log_info("removed ", f, " (left by a killed writer)");
  write_file_atomic(run_dir + "/config.yaml", cfg_.resolved);
  if (!class_list_.empty()) write_file_atomic(run_dir + "/classes.txt", class_list_);  // label i = line i
  metrics_path_ = run_dir + "/metrics.jsonl";
  // A resumed run appends to its metrics; a fresh one starts them anew.
  if (resumed_from_.empty()) std::ofstream(metrics_path_, std::ios::trunc).close();
  if (opts_.print) sinks.add(std::make_unique<ProgressPrinter>(isatty(STDOUT_FILENO)));
  sinks.add(std::make_unique<JsonlSink>(metrics_path_));
  if (cfg_.train.tensorboard) sinks.add(std::make_unique<TensorBoardSink>(run_dir));
  return lock;
}

void Trainer::print_start() const {
  if (!opts_.print) return;
  const int R = group_->world();
  std::vector<Device> local;  // what parallel.devices (e.g. auto) resolved to in this process
  for (int i = 0; i < group_->size(); ++i) local.push_back(group_->replica(i).device());
  std::printf("replica: %s on %s (%d replica%s, %s), %s\n", states_[0].model->summary().c_str(),
              devices_str(local).c_str(), R, R > 1 ? "s" : "", group_->replica(0).pool().describe().c_str(),
              train_->name().c_str());
  std::string precision = cfg_.train.precision;
  if (precision != "fp32") {
    precision += " activations, fp32 master weights";
    const auto* sc = states_[0].scaler.get();
    precision += sc ? ", loss scale " + std::to_string(static_cast<int64_t>(sc->scale())) +
                          (sc->options().dynamic ? " (dynamic)" : " (static)")
                    : std::string(", no loss scaling");
  }
  const auto& shard = states_[0].step->shard_plan();
  if (shard.sharded()) {
    int64_t least = shard.total(), most = 0;
    for (int r = 0; r < shard.world(); ++r) {
      least = std::min(least, shard.hi(r) - shard.lo(r));
      most = std::max(most, shard.hi(r) - shard.lo(r));
    }
    std::printf("replica: parallel.shard %s (%s): %d shards of %ld-%ld of %ld parameters (largest %.3f x an even "
                "share); optimizer state %s per replica\n",
                parallel::shard_mode_name(shard.mode),
                shard.mode == parallel::ShardMode::gradients ? "ZeRO-2: gradients reduce-scattered, optimizer state sharded"
                                                             : "ZeRO-1: optimizer state sharded",
                R, (long)least, (long)most, (long)shard.total(), shard.imbalance(),
                format_bytes(static_cast<size_t>(states_[0].opt->state().size() * most * sizeof(float))).c_str());
  }
  std::printf("replica: global batch %ld = micro-batch %ld x %d accumulation step%s x %d replica%s; %ld steps "
              "(%ld per epoch); %s lr %.4g %s; %s\n",
              (long)cfg_.train.global_batch, (long)micro_, accumulation_, accumulation_ > 1 ? "s" : "", R,
              R > 1 ? "s" : "", (long)total_steps_, (long)sharding_->steps_per_epoch(), cfg_.optim.name.c_str(),
              sched_.base_lr, sched_.kind.c_str(), precision.c_str());
  {  // the training recipe beyond the optimizer, when there is one: what a reader compares with a paper's
    const auto& d = cfg_.data;
    const auto& t = cfg_.train;
    std::string recipe;
    auto add = [&](const std::string& part) { recipe += (recipe.empty() ? "" : ", ") + part; };
    char buf[160];
    if (t.label_smoothing > 0) std::snprintf(buf, sizeof buf, "label smoothing %g", t.label_smoothing), add(buf);
    if (d.mixup_alpha > 0 || d.cutmix_alpha > 0) {
      std::snprintf(buf, sizeof buf, "mixup %g / cutmix %g in pairs (prob %g, cutmix share %g%s)", d.mixup_alpha,
                    d.cutmix_alpha, d.mix_prob, d.mix_switch_prob,
                    d.mix_off_epoch ? (", off from epoch " + std::to_string(d.mix_off_epoch)).c_str() : "");
      add(buf);
    }
    if (d.augment == "randaugment")
      std::snprintf(buf, sizeof buf, "randaugment %ld ops at %ld/30", (long)d.randaugment_ops, (long)d.randaugment_magnitude), add(buf);
    else if (d.augment != "none") add(d.augment);
    if (d.random_erase > 0) std::snprintf(buf, sizeof buf, "random erase %g", d.random_erase), add(buf);
    if (t.ema_decay > 0) std::snprintf(buf, sizeof buf, "weights' moving average %g every %ld step(s)", t.ema_decay, (long)t.ema_every), add(buf);
    if (!recipe.empty()) std::printf("replica: recipe: %s\n", recipe.c_str());
  }
  if (!cpu_tuning_.empty())
    std::printf("replica: cpu kernels %s; %s\n", ops::cpu_kernel_variant().name, cpu_tuning_.c_str());
  if (group_->replica(0).device().kind == DeviceKind::cuda)
    std::printf("replica: train.deterministic %s (%s)\n", resolve_deterministic(cfg_.train) ? "on" : "off",
                resolve_deterministic(cfg_.train)
                    ? "deterministic cuDNN algorithms by cuDNN's ranking: the same seed gives the same bits"
                    : "cuDNN algorithms timed per shape: fastest, but two runs may differ in the last bits");
  if (cfg_.train.cuda_graph != "off" && group_->replica(0).device().kind == DeviceKind::cuda)
    std::printf("replica: train.cuda_graph %s: %s\n", cfg_.train.cuda_graph.c_str(),
                !cuda_graph_note_.empty()
                    ? ("eager, " + cuda_graph_note_).c_str()
                    : cfg_.train.cuda_graph == "auto"
                          ? "the whole step captured as one CUDA graph after 2 eager steps, the first replay "
                            "checked against an eager step, then replayed"
                          : "the whole step captured as one CUDA graph after 2 eager steps, then replayed");
  std::fflush(stdout);
}

void Trainer::print_end(const FitResult& result) const {
  if (!opts_.print) return;
  if (cfg_.memory.step_plan) {
    auto ps = group_->replica(0).pool().plan_stats();
    std::printf("replica: step plan on replica 0: %ld step(s) served, %ld diverged%s; arena %s for %s of peak live "
                "(%zu planned allocations, %zu outside the plan)\n",
                (long)ps.steps_served, (long)ps.steps_diverged,
                ps.last_divergence.empty() ? "" : (" (last: " + ps.last_divergence + ")").c_str(),
                format_bytes(ps.arena_bytes).c_str(), format_bytes(ps.recorded_peak).c_str(), ps.planned, ps.unplanned);
  }
  if (states_[0].scaler)
    std::printf("replica: %ld of %ld steps skipped for overflow\n", (long)result.skipped, (long)result.steps);
  if (const StepGraph* g = states_[0].step ? states_[0].step->graph() : nullptr)
    std::printf("replica: %s\n", g->summary().c_str());
  std::printf("replica: %ld steps in %.1f s (%.0f img/s training); model saved to %s/model.bin, metrics in %s\n",
              (long)result.steps, result.seconds, result.images_per_second, cfg_.train.run_dir.c_str(),
              metrics_path_.c_str());
  std::fflush(stdout);
}

void Trainer::write_traces() {
  if (alloc_trace_) {
    group_->replica(0).pool().set_trace(nullptr);
    alloc_trace_->write_csv(opts_.alloc_trace);
    if (opts_.print)
      std::printf("replica: %zu allocation events of replica 0 written to %s\n", alloc_trace_->events().size(),
                  opts_.alloc_trace.c_str());
  }
  if (timeline_ && group_->lead_process()) {
    timeline_->write_chrome_json(opts_.trace);
    if (opts_.print) std::printf("replica: timeline written to %s (open in https://ui.perfetto.dev)\n", opts_.trace.c_str());
  }
}

// What the planner says fits, measured on this configuration (not guessed): added to an
// out-of-memory error that reaches the trainer, so core/ names no training concept.
std::string Trainer::planner_advice() const {
  try {
    MemPlan plan = plan_memory(cfg_);
    if (plan.best_micro_batch)
      return " The planner (replica memplan) says micro_batch " + std::to_string(plan.best_micro_batch) + " with " +
             std::to_string(plan.accumulation) + " accumulation step(s) fits this pool and keeps global_batch " +
             std::to_string(cfg_.train.global_batch) + " (set train.micro_batch: auto to let it choose).";
    return " The planner finds no micro-batch that fits this pool: use model.checkpoint: blocks, "
           "train.precision: fp16 or bf16, or a larger memory.fraction.";
  } catch (const std::exception&) {
    return "";
  }
}

}  // namespace replica::train
