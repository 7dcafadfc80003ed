// ReplicaStep implementation.
#include "train/replica_step.h"

#include "ops/nn/training_pass.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include "core/errors.h"
#include "core/log.h"

namespace replica::train {

ReplicaStep::ReplicaStep(parallel::Replica& replica, nn::Model& model, optim::Optimizer& opt, StepOptions o)
    : rep_(replica), model_(model), opt_(opt), o_(o) {
  std::vector<int64_t> offsets;
  for (const auto& p : model.registry().params()) offsets.push_back(p.offset);
  if (o_.buckets.wire != DType::f32 && !o_.buckets.staging_pool) o_.buckets.staging_pool = &replica.pool();
  if (!o_.buckets.cast) {
    ops::Backend* be = &ops::backend_for(replica.device());
    o_.buckets.cast = [be](const Tensor& a, const Tensor& b) { be->cast(a, b); };
  }
  const int64_t total = std::max<int64_t>(model.num_params(), 1);  // the flat buffers' size
  const int rank = replica.rank();
  if (model.masters_sharded() && (!o_.shard.sharded() || model.masters_lo() != o_.shard.lo(replica.rank()) ||
                                  model.masters_hi() != o_.shard.hi(replica.rank())))
    throw Error("ReplicaStep: the model's fp32 masters are sharded to [" + std::to_string(model.masters_lo()) + ", " +
                std::to_string(model.masters_hi()) + "), not to this replica's shard");
  if (o_.shard.sharded() && (o_.shard.world() != replica.world() || o_.shard.total() != total))
    throw Error("ReplicaStep: the shard plan covers " + std::to_string(o_.shard.total()) + " elements over " +
                std::to_string(o_.shard.world()) + " replicas; the model has " + std::to_string(total) + " over " +
                std::to_string(replica.world()));
  grads_ = model.grads();
  if (o_.shard.mode == parallel::ShardMode::gradients) {
    // ZeRO-2: no whole gradient buffer. Buckets take storage as backward reaches them and give it
    // back once reduce-scattered; what stays is this replica's shard of the reduced gradient.
    o_.buckets.shard = o_.shard.bounds;
    o_.buckets.release = true;
    o_.buckets.bind = [&model](int slot, const Tensor& g) { model.bind_grad(slot, g); };
    model.release_grads();
    grads_ = Tensor::zeros(replica.pool(), {std::max<int64_t>(o_.shard.hi(rank) - o_.shard.lo(rank), 1)}, DType::f32,
                           MemTag::grads);
  }
  sync_ = std::make_unique<parallel::GradientSync>(offsets, grads_, replica.comm(), o_.buckets);
  stats_ = Tensor::empty(replica.pool(), {kStatCount}, DType::f32, MemTag::other);
  knobs_ = Tensor::zeros(replica.pool(), {kKnobs}, DType::f32, MemTag::other);
  // The norm's blocks: all of them here, unless the reduced gradients are sharded.
  const std::vector<int64_t> blocks = parallel::norm_blocks(offsets, total);
  const int64_t nblocks = static_cast<int64_t>(blocks.size()) - 1;
  partials_ = Tensor::zeros(replica.pool(), {std::max<int64_t>(nblocks, 1)}, DType::f32, MemTag::other);
  int64_t hi = total;
  if (o_.shard.mode == parallel::ShardMode::gradients) {
    for (int64_t b : o_.shard.bounds) {
      auto at = std::lower_bound(blocks.begin(), blocks.end(), b);
      if (at == blocks.end() || *at != b)
        throw Error("ReplicaStep: the shard edge " + std::to_string(b) + " is not an edge of the norm's blocks");
      block_bounds_.push_back(static_cast<size_t>(at - blocks.begin()));
    }
    hi = o_.shard.hi(rank);
    first_block_ = static_cast<int64_t>(block_bounds_[rank]);
  }
  norm_segments_ = parallel::norm_segments(blocks, first_block_, hi);
  if (o_.buckets.release)  // the shard is indexed from its own start
    for (auto& seg : norm_segments_) seg.first -= o_.shard.lo(rank);
  if (o_.cuda_graph != "off") {
    if (const std::string why = cuda_graph_ineligible(o_, replica); !why.empty())
      throw ConfigError("train.cuda_graph: " + o_.cuda_graph + ": " + why);
    graph_ = std::make_unique<StepGraph>(replica, model, opt, stats_, o_.accumulation, o_.cuda_graph == "auto",
                                         o_.deterministic);
  }
}

std::string cuda_graph_ineligible(const StepOptions& o, const parallel::Replica& replica) {
  if (replica.world() > 1 && replica.device().kind == DeviceKind::cuda) {
    for (const parallel::Communicator* c : {&replica.comm(), &replica.lane()})
      if (std::string why = c->cuda_graph_refusal(); !why.empty()) return why;
    if (o.cuda_graph == "auto")
      return "more than one GPU: no multi-GPU run has checked the captured NCCL collectives yet; "
             "train.cuda_graph: on captures them";
  }
  // ZeRO-1 (optimizer) reduces whole buckets as unsharded; its update and gather follow the
  // step's read with peers. ZeRO-2 hands a bucket's storage back when the host sees its
  // collective done, inside backward: no graph holds that.
  if (o.shard.mode == parallel::ShardMode::gradients)
    return "parallel.shard: gradients (buckets are released as the host sees their collectives end)";
  if (o.timeline) return "--trace (it waits on the host inside the step)";
  if (o.fault && (o.fault_site == "bucket" || (o.fault_site == "optimizer" && replica.world() == 1)))
    return "REPLICA_FAULT at " + o.fault_site + " (inside the captured step, whose host hooks run only when it is captured)";
  return "";
}

Tensor ReplicaStep::reduced_grads() const {
  if (o_.shard.mode != parallel::ShardMode::gradients) return grads_;
  return owned_grads();
}

Tensor ReplicaStep::owned_grads() const {
  if (!o_.shard.sharded()) return grads_;
  const int64_t lo = o_.shard.lo(rep_.rank()), hi = o_.shard.hi(rep_.rank());
  if (hi <= lo) return Tensor();
  return o_.buckets.release ? grads_.view(0, {hi - lo}) : grads_.view(lo, {hi - lo});
}

void ReplicaStep::zero_grad() {
  // The buckets' first re-cut (a host broadcast) runs in an eager step, before any capture. A
  // model whose passes never report every slot shows no order to re-cut by: after a few steps the
  // layout stays as it is (on every replica at the same step), so graphs are not held off for good.
  if (graph_ && !sync_->settled() && ++unsettled_steps_ > StepGraph::kWarmupSteps + 2) sync_->keep_layout();
  deferred_ = graph_ && graph_->begin_step(sync_->settled());
  count_ = 0;
  micro_seen_ = 0;
  // The loss weight (each micro-step's loss is weighted by scale / (micro_batch * accumulation))
  // and the scale's inverse (apply's unscale) as the step's device values: the passes and the
  // check read them there, so a captured step serves every loss scale.
  const float values[2] = {loss_weight(), 1.0f / (o_.scaler ? o_.scaler->scale() : 1.f)};
  ops::backend_for(rep_.device()).set_values(knobs_.view(kKnobWeight, {2}), values, 2);
  if (!deferred_) zero_on_device();
}

float ReplicaStep::loss_weight() const {
  const float scale = o_.scaler ? o_.scaler->scale() : 1.f;
  return scale / static_cast<float>(o_.micro_batch * o_.accumulation);
}

void ReplicaStep::zero_on_device() {
  model_.zero_grad();
  sync_->zero();
  ops::backend_for(rep_.device()).fill(stats_, 0.f);
}

void ReplicaStep::micro_step(const Tensor& images, const Tensor& labels, bool last) {
  const auto t0 = std::chrono::steady_clock::now();
  if (micro_seen_ >= o_.accumulation)
    throw Error("ReplicaStep::micro_step: more than " + std::to_string(o_.accumulation) +
                " micro-steps in one step (train.accumulation); apply() ends a step");
  // A deferred step (train.cuda_graph) keeps the micro-batch for apply()'s replay; one that does
  // not fit the graph's input slots runs the step eagerly from here.
  if (deferred_ && !graph_->stage(micro_seen_, images, labels)) {
    deferred_ = false;
    zero_on_device();
    for (int k = 0; k < micro_seen_; ++k) {
      const auto& [im, lb] = graph_->slots()[static_cast<size_t>(k)];
      run_pass(rep_.pool(), im, lb, false);
    }
  }
  if (!deferred_) run_pass(rep_.pool(), images, labels, last);
  phases_.compute += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  count_ += static_cast<double>(images.dim(0));
  micro_seen_++;
}

// Forward, loss and backward of one micro-batch, allocating from `pool`: the replica's, or a
// captured step's own.
void ReplicaStep::run_pass(MemoryPool& pool, const Tensor& images, const Tensor& labels, bool last) {
  auto& be = ops::backend_for(rep_.device());
  const int rebuilt_before = sync_->rebuilds();
  sync_->begin(last);
  if (sync_->rebuilds() != rebuilt_before && rep_.rank() == 0) {
    int packed = 0;
    for (const auto& b : sync_->buckets()) packed += b.ranges.size() > 1;
    log_info("gradient buckets re-cut from the observed readiness order: ", sync_->buckets().size(), " buckets, ",
             packed, " of them gathered from non-adjacent slots");
  }
  const int track = 2 * rep_.rank();
  const bool mark = o_.timeline && last && marked_steps_ < kMarkedSteps;
  if (mark) ++marked_steps_;
  const ops::StepScalar weight(loss_weight(), knobs_.view(kKnobWeight, {1}));
  {
    nn::Context ctx(pool, be, true);
    ctx.act_dtype = o_.activations;
    ctx.bn_frozen = o_.bn_frozen;
    if (o_.sync_bn && rep_.world() > 1)
      ctx.bn_allreduce = [this](float* d, size_t n) { rep_.psum_on_stream(d, n); };
    ctx.on_grads_needed = [this](int first, int count) { sync_->prepare(first, count); };
    ctx.on_grads_ready = [this, last, mark, track](int first, int count) {
      // Traced: when each gradient became final (replica plan --trace-profile reads these).
      if (mark)
        o_.timeline->instant(track, "gradients ready", o_.timeline->now_ns(),
                             {{"first", static_cast<double>(first)}, {"count", static_cast<double>(count)}}, "compute");
      sync_->ready(first, count);
      if (o_.fault && last && sync_->launched_during_backward() > 0) o_.fault("bucket");
    };
    std::optional<Timeline::Scope> fwd;  // no heap allocation per micro-step when not tracing
    fwd.emplace(o_.timeline, track, "forward", "compute");
    Tensor dlogits;
    nn::forward_and_loss(ctx, model_, images, labels, weight, dlogits, stats_.view(kLoss, {3}), o_.label_smoothing);
    fwd.reset();
    Timeline::Scope bwd(o_.timeline, track, last ? "backward (buckets all-reduce as they fill)" : "backward (no_sync)",
                        "compute");
    model_.backward(ctx, dlogits);
  }
}

StepStatus ReplicaStep::apply(float lr, bool stop_requested) {
  if (micro_seen_ != o_.accumulation)
    throw Error("ReplicaStep::apply after " + std::to_string(micro_seen_) + " micro-steps; expected " +
                std::to_string(o_.accumulation));
  const float scale = o_.scaler ? o_.scaler->scale() : 1.f;
  const auto t0 = std::chrono::steady_clock::now();
  // The rest of the step's values on the device (see zero_grad): the sample count, the stop vote,
  // and the optimizer's (the learning rate and what the step count decides).
  auto& be = ops::backend_for(rep_.device());
  const float values[2] = {static_cast<float>(count_), stop_requested ? 1.f : 0.f};
  be.set_values(knobs_.view(kKnobCount, {2}), values, 2);
  opt_.stage(lr);
  // Alone in the job, the update is queued before the host reads the step's scalars: no collective
  // of the step is left to fail, and the device's verdict (step_gate) skips what the host will
  // skip, so the device goes from the backward to the update without waiting for the host. With
  // peers the host reads first, so a failed collective is found before anything changes (the
  // survivors' state stays a completed step's: train/recovery.h). A deferred step (train.cuda_graph)
  // holds all of it, one replay: zeroing, the passes, the collectives, the scalars, and alone in
  // the job the update (with peers the update follows the read, as above).
  const bool update_first = rep_.world() == 1;
  // Whichever way apply() leaves, a queued update is settled: counted only when it was applied.
  struct Settle {
    optim::Optimizer& opt;
    bool applied = false;
    ~Settle() {
      if (opt.pending()) opt.settle(applied);
    }
  } settle{opt_};
  double queued = 0;  // the host's time queueing the update: the optimizer's share, not the wait's
  queue_step(lr, update_first);
  if (update_first && !deferred_) {
    const auto q0 = std::chrono::steady_clock::now();
    queue_update(lr);
    queued = std::chrono::duration<double>(std::chrono::steady_clock::now() - q0).count();
    phases_.optimizer += queued;
  }
  float host[kStatCount];
  read_step_scalars(host);
  if (graph_ && !deferred_) graph_->end_eager();
  const auto t1 = std::chrono::steady_clock::now();
  phases_.allreduce_wait += std::chrono::duration<double>(t1 - t0).count() - queued;
  // Everything after the wait, whichever way apply() returns, is the optimizer's share.
  struct OptimizerTime {
    double& into;
    std::chrono::steady_clock::time_point t;
    ~OptimizerTime() { into += std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count(); }
  } optimizer_time{phases_.optimizer, t1};
  bool sound = false;  // finite gradients and loss: the step applies
  StepStatus st = status_from(host, lr, scale, sound);
  if (o_.scaler) {
    if (!o_.scaler->update(sound, st.step)) {
      st.applied = false;
      st.step = opt_.steps();
      st.grad_norm = std::nan("");
      check_leaks();
      return st;
    }
  } else if (!sound) {
    throw TrainingError(std::string(std::isfinite(st.loss) ? "the gradients are not finite" : "the loss is NaN") +
                        " at step " + std::to_string(st.step) + " (lr " + std::to_string(lr) +
                        "): the run diverged. Lower optim.lr, add optim.warmup_epochs, clip gradients "
                        "(optim.clip_grad_norm), or check the data.");
  }
  st.grad_norm = std::sqrt(static_cast<double>(host[kGradSquares]));
  if (!update_first) queue_update(lr);
  settle.applied = true;
  check_leaks();
  if (o_.timeline) trace_pool_peaks();
  return st;
}

// The step's device work up to its scalars: queued eagerly, or (a deferred step) one replay of
// the captured step, which alone in the job holds the update too; with peers the update stays out
// of the graph and follows the host's read, as eagerly.
void ReplicaStep::queue_step(float lr, bool update_first) {
  replayed_.reset();
  replayed_lane_.reset();
  if (!deferred_) {
    finish_gradients();
    queue_step_scalars();
    return;
  }
  const int64_t replays = graph_->replays();
  graph_->run([&](MemoryPool& pool, const StepGraph::Inputs& in) {
    zero_on_device();
    for (size_t k = 0; k < in.size(); ++k)
      run_pass(pool, in[k].first, in[k].second, static_cast<int>(k) == o_.accumulation - 1);
    finish_gradients();
    queue_step_scalars();
    if (update_first) queue_update(lr);
  });
  if (update_first && !opt_.pending()) opt_.replayed(lr);  // only the graph ran: its update is this step's
  if (graph_->replays() > replays && rep_.world() > 1) {
    // The graph ran last: the handles its capture made name no run of it.
    metrics_.reset();
    partials_work_.reset();
    sync_->forget_work();
    replayed_ = rep_.comm().stream_work(rep_.stream(), "collectives of the replayed step");
    if (rep_.has_lane())
      replayed_lane_ = rep_.lane().stream_work(rep_.stream(), "sync-BN collectives of the replayed step");
  }
}

// The step's scalars as read on the host, and whether the step is `sound` (finite gradients and
// loss). Labels beyond the model's classes end the run (every
// replica saw the sum: all of them stop here together), and so does a device verdict that is not
// the host's: every replica holds the same reduced loss and gradients, so every replica reaches
// the same verdict and stops, skips or steps together, and the device reached it too.
StepStatus ReplicaStep::status_from(const float* host, float lr, float scale, bool& sound) const {
  if (host[kBadLabel] > 0)
    throw ShapeError("softmax_cross_entropy: " + std::to_string(static_cast<int64_t>(host[kBadLabel])) +
                     " micro-batch(es) of step " + std::to_string(opt_.steps() + 1) +
                     " hold a label outside [0, " + std::to_string(model_.classes()) +
                     "): the data has more classes than model.num_classes");
  StepStatus st;
  st.stop = host[kStop] > 0;
  st.samples = static_cast<int64_t>(host[kCount]);
  st.loss = host[kLoss] / host[kCount];
  st.accuracy = host[kCorrect] / host[kCount];
  st.lr = lr;
  st.step = opt_.steps() + 1;
  st.scale = scale;
  sound = host[kNonFinite] == 0.f && std::isfinite(st.loss);
  if ((host[kApply] != 0.f) != sound)
    throw Error("ReplicaStep: the device's verdict on step " + std::to_string(st.step) + " (apply " +
                std::to_string(host[kApply]) + ") is not the host's (" + (sound ? "apply" : "skip") +
                "): a bug in Backend::step_gate");
  return st;
}

// The update as the device decides it: clipped by the factor step_gate left, applied only where
// its verdict says so.
void ReplicaStep::queue_update(float lr) {
  auto& be = ops::backend_for(rep_.device());
  if (o_.clip_grad_norm > 0) {
    // Sharded, the optimizer reads its own range only, so only that range is clipped.
    const Tensor g = owned_grads();
    if (g.defined()) be.scale_by(g, stats_.view(kClip, {1}));
  }
  if (o_.fault) o_.fault("optimizer");
  Timeline::Scope opt(o_.timeline, 2 * rep_.rank(), "optimizer", "compute");
  // Queued on the compute stream, no host wait. ZeRO-2 hands over the shard alone. The update
  // writes the 16-bit compute copy of what it updates in its own pass, where that is all of the
  // copy or all this replica's part of it: unsharded, or with sharded masters (the shard's copy,
  // then everyone's: half the bytes). A sharded optimizer over whole f32 masters gathers the f32
  // parameters first and rounds them all after.
  const bool copy_in_update = !o_.shard.sharded() || model_.masters_sharded();
  opt_.step_gated(model_.params(), grads_, lr, copy_in_update ? model_.compute_copy() : Tensor(),
                  stats_.view(kApply, {1}));
  gather_parameters();
  if (!copy_in_update) model_.refresh_compute_copy();
}

void ReplicaStep::finish_gradients() {
  {
    // On a GPU the compute stream waits for the buckets on the device (no host wait; a trace
    // waits on the host instead, to time each bucket).
    Timeline::Scope wait(o_.timeline, 2 * rep_.rank(), "wait for gradient all-reduce", "comm");
    sync_->finish(o_.timeline ? nullptr : &rep_.stream());
  }
  if (!o_.timeline || rep_.world() == 1) return;
  int i = 0;
  for (const auto& b : sync_->buckets())
    if (b.work)
      o_.timeline->slice(2 * rep_.rank() + 1, "all-reduce bucket " + std::to_string(i++) + " (" +
                                                  format_bytes(static_cast<size_t>(b.elements) * 4) + ")",
                         o_.timeline->from_steady(b.launched_ns), o_.timeline->from_steady(b.done_ns), "comm");
}

// The step's scalars stay on the device until one read: the loss, accuracy, bad-label flag,
// sample count and stop vote summed across replicas in one small collective (a signal reaches
// replicas at slightly different moments; the sum makes them agree), then the finite check and
// the squared norm of the reduced gradients, then the verdict and the clip factor (step_gate);
// read_step_scalars copies them to the host at once.
void ReplicaStep::queue_step_scalars() {
  auto& be = ops::backend_for(rep_.device());
  static_assert(kStop == kCount + 1 && kKnobStop == kKnobCount + 1, "count and stop are copied together");
  // A device copy through the backend (f32 to f32), queued like the ops around it: a CUDA graph
  // captures it with them.
  be.cast(knobs_.view(kKnobCount, {2}), stats_.view(kCount, {2}));
  // The finite check first: sharded, each replica sees only its part, and the flag is summed with
  // the metrics.
  const Tensor mine = reduced_grads();
  const float inv_scale = 1.0f / (o_.scaler ? o_.scaler->scale() : 1.f);
  if (mine.defined())
    be.unscale_check_finite_into(mine, ops::StepScalar(inv_scale, knobs_.view(kKnobInvScale, {1})),
                                 stats_.view(kNonFinite, {1}));
  metrics_.reset();
  partials_work_.reset();
  if (rep_.world() > 1) {
    metrics_ = rep_.comm().all_reduce_async(stats_.raw(), kReducedStats, DType::f32, parallel::ReduceOp::sum);
    metrics_->order_before(rep_.stream());
  }
  // The squared norm over the fixed blocks, added in block order: the same bits for any replica
  // count and with or without sharding (a sharded replica computes its blocks and gathers the rest).
  const int64_t nmine = static_cast<int64_t>(norm_segments_.size());
  if (nmine > 0)
    be.segment_sum_squares_into(grads_, norm_segments_, partials_.view(first_block_, {nmine}));
  if (!block_bounds_.empty() && rep_.world() > 1) {
    partials_work_ = rep_.comm().all_gather_v_async(partials_.raw(), static_cast<size_t>(partials_.numel()),
                                                    DType::f32, block_bounds_);
    partials_work_->order_before(rep_.stream());
  }
  be.sum_in_order_into(partials_, stats_.view(kGradSquares, {1}));
  ops::Backend::StepGateAt at;
  at.loss = kLoss;
  at.bad_label = kBadLabel;
  at.nonfinite = kNonFinite;
  at.grad_squares = kGradSquares;
  at.apply = kApply;
  at.clip = kClip;
  be.step_gate(stats_, at, o_.clip_grad_norm);
}

void ReplicaStep::read_step_scalars(float* host) {
  ops::backend_for(rep_.device()).read_to_host(stats_, host, [&] {
    if (metrics_) metrics_->check();
    if (partials_work_) partials_work_->check();
    if (replayed_) replayed_->check();
    if (replayed_lane_) replayed_lane_->check();
    sync_->check();
  });
}

// Sharded: each replica updated its own range; every replica gets all of them (in place): the f32
// parameters, or with sharded masters the 16-bit copy the layers read.
void ReplicaStep::gather_parameters() {
  if (!o_.shard.sharded() || rep_.world() == 1) return;
  Tensor& p = model_.replicated_params();
  std::vector<size_t> bounds(o_.shard.bounds.begin(), o_.shard.bounds.end());
  rep_.comm().all_gather_v_async(p.raw(), static_cast<size_t>(p.numel()), p.dtype(), bounds)->order_before(rep_.stream());
}

void ReplicaStep::trace_pool_peaks() {
  auto ps = rep_.pool().stats();
  std::vector<std::pair<std::string, double>> v;
  for (int t = 0; t < kNumTags; ++t) v.emplace_back(mem_tag_name(static_cast<MemTag>(t)), ps.tags[t].peak_in_use / 1048576.0);
  o_.timeline->counter(2 * rep_.rank(), "replica " + std::to_string(rep_.rank()) + " pool peak MiB by tag",
                       o_.timeline->now_ns(), std::move(v));
}

void ReplicaStep::check_leaks() {
  auto s = rep_.pool().stats();
  const MemTag watched[] = {MemTag::activations, MemTag::workspace};
  if (steps_seen_++ == 0) {
    for (MemTag t : watched) baseline_[static_cast<int>(t)] = s.tags[static_cast<int>(t)].in_use;
    return;
  }
  std::string report;
  for (MemTag t : watched) {
    const int i = static_cast<int>(t);
    if (s.tags[i].in_use <= baseline_[i]) continue;
    report += std::string(mem_tag_name(t)) + " grew by " + format_bytes(s.tags[i].in_use - baseline_[i]) +
              " since the first step (now " + format_bytes(s.tags[i].in_use) + " live between steps); held by:";
    int shown = 0;
    for (auto& [site, bytes] : rep_.pool().live_by_site(t))
      if (shown++ < 3) report += " " + site + " (" + format_bytes(bytes) + ")";
    report += ". ";
    baseline_[i] = s.tags[i].in_use;  // warn again only if it keeps growing
  }
  if (!report.empty()) {
    leak_report_ = "possible leak on replica " + std::to_string(rep_.rank()) + " at step " +
                   std::to_string(opt_.steps()) + ": " + report;
    log_warn(leak_report_);
  }
}

EvalSums ReplicaStep::eval_batch(const Tensor& images, const Tensor& labels) {
  auto& be = ops::backend_for(rep_.device());
  nn::Context ctx(rep_.pool(), be, false);
  ctx.act_dtype = o_.activations;
  Tensor logits = model_.forward(ctx, images);
  Tensor probs = ctx.alloc(logits.shape(), MemTag::activations, DType::f32);
  auto r = be.softmax_xent_forward(logits, labels, probs);
  return {r.loss_sum, static_cast<double>(r.correct), static_cast<double>(images.dim(0)),
          static_cast<double>(r.correct5)};
}

}  // namespace replica::train
