// ReplicaStep: one replica's training step, with the micro-step loop in plain sight (llm.c's
// style) so a custom trainer can drive it:
//
//   rs.zero_grad();
//   for (k = 0; k < accumulation; ++k)
//     rs.micro_step(batch[k].images, batch[k].labels, /*last=*/k == accumulation - 1);
//   StepStatus st = rs.apply(lr);   // waits for the bucket all-reduces, checks, updates
//
// One host synchronisation per optimizer step, on every backend: the loss, accuracy and checks
// stay on the device (a GPU queues everything, the compute stream waits for the collectives on
// the device) until apply() reads them in one small copy; ops::host_syncs_on_this_thread()
// counts, and tests/train/test_host_syncs.cpp holds the step to it.
//
// Gradients add up across micro-steps with no communication (no_sync); the last micro-step's
// backward starts the bucket all-reduces as buckets fill. Each micro-step's loss is weighted by
// 1 / (micro_batch * accumulation), and the all-reduce averages over replicas, so the update
// equals one step on the whole global batch.
//
// Mixed precision: the loss is also multiplied by the loss scale; apply() unscales the
// all-reduced gradients and checks them for inf/NaN in one pass, so every replica reaches the
// same verdict. An overflowing step is skipped: no parameter, optimizer state or step count
// changes, and the returned StepStatus says so (applied = false). The verdict and the clip factor
// are reached on the device too (Backend::step_gate) and the update is gated by it, so a replica
// alone in the job queues its update before the one host read (the device does not wait for the
// host between backward and update); with peers the host reads first, so a failed collective is
// found before anything changes.
#pragma once
#include <array>
#include <functional>
#include <memory>
#include <string>

#include "core/timeline.h"
#include "ops/nn/model.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "parallel/gradient_sync.h"
#include "parallel/replica_group.h"
#include "parallel/shard_plan.h"
#include "train/step_graph.h"

namespace replica::train {

struct StepStatus {
  bool applied = true;    // false when the step was skipped (never, in fp32)
  int64_t step = 0;       // optimizer steps applied so far, this one included
  double loss = 0;        // mean over the global batch
  double accuracy = 0;    // fraction correct over the global batch
  double grad_norm = 0;   // L2 norm of the averaged gradient
  float lr = 0;
  float scale = 1;        // loss scale (1 in fp32)
  int64_t samples = 0;    // global batch size
  bool stop = false;      // some replica was asked to stop (a signal): the same on every replica
};

struct EvalSums {
  double loss_sum = 0;
  double correct = 0;
  double count = 0;
  double correct5 = 0;  // labels among the 5 largest logits (top-5)
};

struct StepOptions {
  int accumulation = 1;
  int64_t micro_batch = 1;
  bool sync_bn = false;
  bool bn_frozen = false;                    // batch norm on running statistics
  DType activations = DType::f32;            // f16 / bf16: 16-bit activations (mixed precision)
  optim::DynamicLossScaler* scaler = nullptr;  // loss scaling (fp16); nullptr: none
  double clip_grad_norm = 0;                 // 0: no clipping
  float label_smoothing = 0;                 // train.label_smoothing: the loss's target
  parallel::BucketOptions buckets;
  // parallel.shard (ZeRO-1/2): the optimizer updates this replica's shard only (its state covers
  // that shard: see optim::ShardRange) and the updated parameters are all-gathered; in
  // `gradients` mode the buckets are reduce-scattered as well, and the finite check, the norm and
  // clipping read the shard. Unsharded (mode none) by default.
  parallel::ShardPlan shard;
  // REPLICA_FAULT's hook (train/recovery.h): called at "bucket" (the last micro-step's backward,
  // once a gradient bucket was sent) and "optimizer" (after the step's collectives); may throw.
  std::function<void(const char* where)> fault;
  // Where the planned fault strikes (REPLICA_FAULT's WHERE): a site inside the captured step (a
  // bucket; the update, which a replica alone in its job captures) runs its host hook only when
  // the step is captured, not on its replays, so train.cuda_graph cannot serve it.
  std::string fault_site;
  Timeline* timeline = nullptr;  // `--trace`: slices for forward, backward, all-reduces, optimizer
  // train.cuda_graph: "off", "on" (the whole step captured as a CUDA graph after a warm-up and
  // replayed: micro_step() then copies its micro-batch into the graph's inputs and apply() runs
  // the step) or "auto" (the same, the first replay checked against an eager step); see
  // train/step_graph.h. Only where cuda_graph_ineligible says nothing. On a CPU replica the step
  // is recorded as its backend calls and replayed the same way (no faster: how the CPU suite tests
  // the mechanism; the trainer keeps CPU runs eager).
  std::string cuda_graph = "off";
  bool deterministic = false;  // train.deterministic in force: auto's check is then bit for bit
};

// Why train.cuda_graph cannot serve this replica's step ("" when it can): unsharded or ZeRO-1
// (parallel.shard: optimizer), without a trace or a fault planned inside the captured step; with
// peers, collectives a graph can hold (NCCL's, or a CPU replica's recorded ones; not collectives
// staged through the host), and on GPUs `on` only: `auto` keeps several GPUs eager until a
// multi-GPU run has checked the captured collectives. (The trainer adds: a GPU replica, unless it
// records CPU steps.)
std::string cuda_graph_ineligible(const StepOptions& o, const parallel::Replica& replica);

// Where one replica's step time went, summed over the run (the run report splits wall time by it).
struct PhaseSeconds {
  double compute = 0;         // forward, loss and backward (all-reduces overlap the backward)
  // Waiting for the gradient buckets after backward and for the step's one read of its scalars
  // (on a GPU this wait also holds the device's compute that the host queued ahead of it).
  double allreduce_wait = 0;
  double optimizer = 0;       // metrics reduction, finite check, clipping, the update
};

class ReplicaStep {
 public:
  ReplicaStep(parallel::Replica& replica, nn::Model& model, optim::Optimizer& opt, StepOptions o);

  void zero_grad();
  // Forward, loss, backward on one micro-batch; `last` starts the gradient all-reduce.
  void micro_step(const Tensor& images, const Tensor& labels, bool last);
  // Waits for the all-reduce, reduces the metrics, checks the loss, updates the parameters.
  // `stop_requested` is this replica's stop vote; it travels in the metrics' reduction (one
  // collective for loss, accuracy, count and the vote) and comes back as StepStatus::stop.
  StepStatus apply(float lr, bool stop_requested = false);
  // Forward in eval mode; returns this replica's sums (the caller reduces across replicas).
  EvalSums eval_batch(const Tensor& images, const Tensor& labels);

  // train.cuda_graph's state (null when off): its line for the run's end.
  const StepGraph* graph() const { return graph_.get(); }

  // Leak check, run at the end of every step: activations and workspace must return to what
  // they held after the first step. Growth is a warning naming the tag and the layers whose
  // allocations are still alive; the last report (empty when clean) is kept here.
  const std::string& leak_report() const { return leak_report_; }

  nn::Model& model() { return model_; }
  parallel::Replica& replica() { return rep_; }
  const parallel::GradientSync& sync() const { return *sync_; }
  const PhaseSeconds& phases() const { return phases_; }
  const parallel::ShardPlan& shard_plan() const { return o_.shard; }
  // Waits until no collective of this replica's last step is still running (they have failed
  // or finished), ignoring their errors: before the buffers go, after the group was aborted.
  void drain() { sync_->drain(); }

 private:
  parallel::Replica& rep_;
  nn::Model& model_;
  optim::Optimizer& opt_;
  StepOptions o_;
  std::unique_ptr<parallel::GradientSync> sync_;
  void check_leaks();
  // apply()'s steps: the step's device work (eager or one replay); wait for (or order after) the
  // gradient buckets; the one host read and what it says; the sharded update's all-gather of the
  // parameters.
  void queue_step(float lr, bool update_first);
  StepStatus status_from(const float* host, float lr, float scale, bool& sound) const;
  void finish_gradients();
  void queue_step_scalars();
  // The step's device work in pieces, the same eagerly and inside a captured step: zeroing the
  // gradients and scalars, and one micro-batch's forward, loss and backward from `pool`.
  void zero_on_device();
  // Each micro-step's loss weight: the loss scale over micro_batch * accumulation.
  float loss_weight() const;
  void run_pass(MemoryPool& pool, const Tensor& images, const Tensor& labels, bool last);
  void read_step_scalars(float* host);
  void queue_update(float lr);
  void gather_parameters();
  // The reduced gradients this replica reads: its shard in `gradients` mode, all of them otherwise.
  Tensor reduced_grads() const;
  // The part of them its optimizer updates: its shard when sharded (undefined when empty).
  Tensor owned_grads() const;
  // Where the reduced gradients land: the model's flat buffer, or under ZeRO-2 this replica's shard
  // alone, the only gradient memory kept between steps (the flat buffer is released).
  Tensor grads_;
  // The gradient norm's fixed blocks (parallel::norm_blocks): this replica's to compute, their
  // first index, and the block bounds of every shard (gradients mode: the partials are gathered).
  std::vector<std::pair<int64_t, int64_t>> norm_segments_;
  int64_t first_block_ = 0;
  std::vector<size_t> block_bounds_;
  Tensor partials_;
  void trace_pool_peaks();
  // The step's scalars (f32, on the replica's device): filled by the micro-steps and apply(), read
  // by the host once per optimizer step. [0, kReducedStats) is summed across replicas.
  enum : int64_t {
    kLoss = 0, kCorrect = 1, kBadLabel = 2,  // softmax_xent_accumulate's three, in its order
    kCount = 3, kStop = 4,
    kNonFinite = 5,  // summed too: sharded, each replica checks its own part of the gradients
    kReducedStats = 6,
    kGradSquares = 6,  // of the reduced gradients, from the fixed blocks: the same on every replica
    kApply = 7, kClip = 8,  // Backend::step_gate's verdict and clip factor, from the reduced values
    kStatCount = 9
  };
  Tensor stats_;
  // The step's values that change from step to step, on the device (ops::StepScalar), written by
  // the host before the step's work: the loss weight and the scale's inverse (zero_grad), the
  // sample count and the stop vote (apply), copied into stats_ by the step's work.
  enum : int64_t { kKnobWeight = 0, kKnobInvScale = 1, kKnobCount = 2, kKnobStop = 3, kKnobs = 4 };
  Tensor knobs_;
  bool deferred_ = false;  // this step's device work waits for apply() (train.cuda_graph)
  parallel::WorkHandle metrics_, partials_work_;  // this step's scalar collectives (world > 1)
  // A replayed step's collectives (world > 1): polled by the step's host read in place of the
  // handles above, which name the capture (Communicator::stream_work), for the communicator and
  // the latency lane.
  parallel::WorkHandle replayed_, replayed_lane_;
  std::unique_ptr<StepGraph> graph_;
  double count_ = 0;
  int micro_seen_ = 0;
  // Steps whose "gradients ready" moments went into the trace: the first kMarkedSteps only (what
  // replica plan --trace-profile needs; a long run's trace stays the size it was).
  static constexpr int kMarkedSteps = 64;
  int marked_steps_ = 0;
  int64_t steps_seen_ = 0;
  int unsettled_steps_ = 0;  // steps train.cuda_graph waited for the buckets' layout to settle
  std::array<size_t, kNumTags> baseline_{};
  std::string leak_report_;
  PhaseSeconds phases_;
};

}  // namespace replica::train
