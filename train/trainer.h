// Trainer: the fit loop of `replica train`. Every replica thread runs the same loop (pmap style)
// over its shard; rank 0 prints progress and writes the run directory: the resolved config,
// metrics.jsonl (one line per logged step and per evaluation) and the final model.
#pragma once
#include <atomic>
#include <functional>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "core/alloc_trace.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "train/input_stager.h"
#include "optim/schedule.h"
#include "parallel/replica_group.h"
#include "core/file_io.h"
#include "train/checkpoint.h"
#include "train/checkpoint_policy.h"
#include "train/config.h"
#include "train/ema.h"
#include "train/metrics_sink.h"
#include "train/recovery.h"
#include "train/run_report.h"
#include "train/replica_step.h"

namespace replica::train {

struct EvalResult {
  double loss = 0, accuracy = 0, top5 = 0;  // top-5: the label among the 5 largest logits
  int64_t count = 0;
};

struct FitResult {
  int64_t steps = 0;
  double last_loss = 0;
  EvalResult test;
  EvalResult test_ema;  // the weights' moving average (train.ema_decay; count 0: none)
  double seconds = 0;
  double images_per_second = 0;  // training throughput (evaluation excluded)
  int64_t skipped = 0;           // steps skipped for overflowing gradients (fp16)
  bool stopped_by_signal = false;  // a stop vote: a signal or parallel.preempt_file (stopped_by says which)
  std::string stopped_by;
  std::string last_checkpoint;
  std::vector<StepStatus> history;  // every step (rank 0's view; all ranks agree)
};

struct TrainerOptions {
  bool print = true;  // progress to stdout (a bar on a terminal, lines otherwise)
  std::function<void(const StepStatus&)> on_step;  // rank 0, after each step
  // Resume from a run directory (its newest valid checkpoint) or a checkpoint file.
  std::string resume;
  // Write a Chrome-trace timeline of the run here (Perfetto, chrome://tracing).
  std::string trace;
  // Record replica 0's pool allocations and write them as CSV (replica bench alloc --replay).
  std::string alloc_trace;
  // train.cuda_graph on CPU replicas too: their steps recorded and replayed with a CUDA graph's
  // contract (train/step_graph.h, core/captured_work.h). No faster; how the CPU suite runs the
  // trainer's graphed path (tests/train/test_step_graph.cpp). Off: CPU replicas stay eager.
  bool record_cpu_steps = false;
};

// Builds the data set of a configuration's split ("train" / "test").
std::shared_ptr<data::Dataset> make_dataset(const DataConfig& d, const std::string& split);

class Trainer {
 public:
  explicit Trainer(RunConfig cfg, TrainerOptions opts = {});
  ~Trainer();
  FitResult fit();
  EvalResult evaluate();  // after fit (or on freshly initialised / loaded weights)

  parallel::ReplicaGroup& group() { return *group_; }
  nn::Model& model(int local_index) { return *states_[local_index].model; }
  const ReplicaStep& replica_step(int local_index) const { return *states_[local_index].step; }
  int replicas() const { return group_->world(); }  // over all processes
  int accumulation() const { return accumulation_; }
  int64_t micro_batch() const { return micro_; }
  int64_t steps_per_epoch() const { return sharding_->steps_per_epoch(); }
  const RunConfig& config() const { return cfg_; }

 private:
  struct State {
    std::unique_ptr<nn::Model> model;
    std::unique_ptr<optim::Optimizer> opt;
    std::unique_ptr<optim::DynamicLossScaler> scaler;
    std::unique_ptr<ReplicaStep> step;
    // Pinned host memory batches are assembled in before their copy to a GPU (null on CPU).
    std::unique_ptr<MemoryPool> staging;
    std::unique_ptr<data::ReplicaLoader> loader;
    std::unique_ptr<Stream> stage_stream;  // CPU replicas under REPLICA_STAGE_AHEAD=1 only
    std::unique_ptr<InputStager> inputs;  // batches to the device ahead of use (copy stream)
    // The memory-pressure rule over this replica's step peaks (its own thread observes it).
    MemoryPressure pressure{50};
    // parallel.on_replica_failure: shrink: the last completed step and its statistics; and the
    // step this replica is running (for REPLICA_FAULT).
    StepMemory memory;
    int64_t running_step = 0;
    std::unique_ptr<WeightEma> ema;  // train.ema_decay: the weights' moving average (train/ema.h)
    MemoryPool& input_pool(parallel::Replica& rep) { return staging ? *staging : rep.pool(); }
  };
  void init_schedule();
  void check_classes();
  void build(const std::vector<Device>& devices);
  void init_from_file(parallel::Replica& rep, nn::Model& model);
  void init_replica(parallel::Replica& rep, const Shape& sample, DType compute);
  // Evaluation on the replicas' averaged statistics; the training state is left as it was.
  EvalResult evaluate_on(parallel::Replica& rep);
  EvalResult evaluate_averaged(parallel::Replica& rep);  // with the statistics already averaged
  // The moving average evaluated as the model (every replica calls it): the live weights are put
  // back after, bit for bit.
  EvalResult evaluate_ema(parallel::Replica& rep);
  // The moving average's f32 weights whole and its batch-norm statistics averaged over the
  // replicas, as model_ema.bin holds them (every replica calls it; rank 0 writes).
  void save_ema_model(parallel::Replica& rep);
  EmaOptions ema_options() const;

  // The fit loop's state shared by the replica threads (written by rank 0).
  struct FitLoop {
    CheckpointPolicy checkpoints;  // the policy; each replica thread works on its own copy
    int64_t epochs;
    MetricsSinks sinks;
    FitResult result;
    double train_seconds;  // evaluation excluded
    double eval_seconds = 0, checkpoint_seconds = 0;  // rank 0's
  };
  void fit_replica(parallel::Replica& rep, FitLoop& loop);
  RunReport run_report(const FitLoop& loop) const;
  // One optimizer step: the micro-steps over the next batches, the all-reduce, the update and
  // the stop vote (StepStatus::stop).
  StepStatus train_step(parallel::Replica& rep, int64_t global_step, bool more_in_epoch);
  StepRecord step_record(parallel::Replica& rep, const StepWindow& window, const StepStatus& last, int64_t step,
                         int64_t epoch);
  std::unique_ptr<DirectoryLock> open_run_directory(MetricsSinks& sinks);
  void print_start() const;
  void print_end(const FitResult& result) const;
  void write_traces();
  std::string planner_advice() const;  // appended to an out-of-memory error: what the planner says fits
  // Called on every replica at the same step (rank 0 writes); records it in the loop.
  void save_checkpoint(parallel::Replica& rep, FitLoop& loop, CheckpointPolicy& checkpoints, int64_t global_step,
                       int64_t epoch, int64_t step_in_epoch);
  std::string write_checkpoint_file(parallel::Replica& rep, const CheckpointPolicy& policy, int64_t global_step,
                                    int64_t epoch, int64_t step_in_epoch);
  // The optimizer's state tensors whole, concatenated (rank 0 gets the bytes; every replica must
  // call it): sharded state is gathered, so the checkpoint is the same as an unsharded run's.
  std::string gather_optimizer_state(parallel::Replica& rep);
  // The f32 master parameters whole, as bytes (every replica must call it; rank 0 gets them, the
  // others too when sharded): params() itself, or gathered from the shards.
  std::string gather_masters(parallel::Replica& rep);
  // `range` (f32, this replica's range of the masters: all of them, or its shard when sharded)
  // whole on every replica, as bytes (every replica must call it).
  std::string whole_of(parallel::Replica& rep, const Tensor& range);
  // A checkpoint of the master parameters `params` (f32 bytes, whole), `st`'s optimizer step count
  // and scaler, with every replica's batch-norm statistics (`buffers`, one per replica: the
  // checkpoint's world) and the whole optimizer state `opt_state`, at the given data position.
  // With a moving average, `ema` holds its weights whole and `ema_buffers` its statistics per replica.
  Checkpoint compose_checkpoint(const State& st, const std::string& params, const std::vector<std::string>& buffers,
                                const std::string& opt_state, int64_t global_step, int64_t epoch,
                                int64_t step_in_epoch, const std::string& ema = "",
                                const std::vector<std::string>& ema_buffers = {}) const;
  // Loads the newest valid checkpoint (falling back with a warning past damaged ones), or
  // `in_memory` (named opts_.resume in messages: a shrink's checkpoint, being written meanwhile).
  void load_resume_point(const Checkpoint* in_memory = nullptr);
  // One replica's part of it (run on the replica's thread).
  void restore_replica(parallel::Replica& rep, const Checkpoint& ck, int old_world, int64_t optimizer_steps);
  void restore_ema(parallel::Replica& rep, const Checkpoint& ck, int old_world);
  // train/recovery.cpp. After each completed step (and at the start): what a shrink continues from.
  void remember_step(parallel::Replica& rep, int64_t step);
  // parallel.on_replica_failure: shrink, one process: when exactly one replica failed, writes the
  // last completed step as a checkpoint, rebuilds the group on the survivors and resumes from it
  // (returns true); false when the failure is not one to shrink past. Throws TrainingError below
  // parallel.min_replicas (after the checkpoint).
  bool shrink_to_survivors(const parallel::ReplicaError& e, FitLoop& loop);
  Checkpoint last_step_checkpoint(const std::vector<int>& survivors, int64_t step) const;
  // REPLICA_FAULT's hook (a no-op without it): replica `rep` at `where` of its running step.
  void fault_point(parallel::Replica& rep, const char* where);
  std::string checkpoint_dir() const;

  RunConfig cfg_;
  TrainerOptions opts_;
  parallel::GroupOptions go_;
  std::optional<FaultInjector> fault_;
  std::string cpu_tuning_;  // CPU runs: the kernels' per-CPU choice and why (ops/cpu/tuning.h)
  std::vector<std::string> events_;  // replicas lost and how the run went on (the run report)
  std::atomic<bool> preempt_noticed_{false};  // some replica of this process saw parallel.preempt_file
  std::shared_ptr<data::Dataset> train_, test_;
  std::unique_ptr<parallel::ReplicaGroup> group_;
  std::unique_ptr<data::Sharding> sharding_;
  std::vector<State> states_;
  std::string class_list_;  // image folders: one class name per line (RUN_DIR/classes.txt)
  data::AugmentOptions aug_;
  optim::ScheduleOptions sched_;
  int accumulation_ = 1;
  int64_t micro_ = 0, total_steps_ = 0;
  std::string metrics_path_;
  std::string cuda_graph_note_;  // why train.cuda_graph: auto stays eager here ("" when it does not)
  std::unique_ptr<Timeline> timeline_;
  std::unique_ptr<AllocTrace> alloc_trace_;
  // Where a resumed run starts.
  int64_t start_global_step_ = 0, start_epoch_ = 0, start_step_in_epoch_ = 0;
  std::string resumed_from_;
};

}  // namespace replica::train
