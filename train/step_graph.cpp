// StepGraph: the whole training step captured as a CUDA graph and replayed (train.cuda_graph).
#include "train/step_graph.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/errors.h"
#include "core/log.h"
#include "core/units.h"
#include "ops/backend.h"

namespace replica::train {

namespace {
// "" when `a` (eager) and `b` (replayed) agree: every bit, or within 1e-3 of a's largest magnitude.
std::string compare(const std::string& what, const Tensor& a, const Tensor& b, bool exact) {
  const std::string x = tensor_to_bytes(a), y = tensor_to_bytes(b);
  if (x == y) return "";
  if (a.dtype() != DType::f32) return what + " differ; ";
  std::vector<float> u(x.size() / 4), v(y.size() / 4);
  std::memcpy(u.data(), x.data(), x.size());
  std::memcpy(v.data(), y.data(), y.size());
  double largest = 0, diff = 0;
  int64_t differing = 0;
  for (size_t i = 0; i < u.size(); ++i) {
    largest = std::max(largest, std::abs(static_cast<double>(u[i])));
    const double d = std::abs(static_cast<double>(u[i]) - v[i]);
    if (!(d == 0)) ++differing;  // NaN against a number counts
    diff = std::isnan(d) ? INFINITY : std::max(diff, d);
  }
  const double rel = diff / std::max(largest, 1e-30);
  if (!exact && rel <= 1e-3) return "";
  return what + ": " + std::to_string(differing) + " of " + std::to_string(u.size()) +
         " elements differ, by up to " + std::to_string(rel) + " of the largest; ";
}
}  // namespace

StepGraph::StepGraph(parallel::Replica& replica, nn::Model& model, optim::Optimizer& opt, Tensor stats,
                     int micro_steps, bool verify, bool deterministic)
    : rep_(replica),
      model_(model),
      opt_(opt),
      stats_(std::move(stats)),
      micro_steps_(micro_steps),
      verify_(verify),
      deterministic_(deterministic) {}

StepGraph::~StepGraph() {
  graph_.reset();
  pool_.reset();
  if (block_) rep_.pool().deallocate(block_);
}

void StepGraph::turn_off(const std::string& why) {
  off_ = why;
  log_warn("train.cuda_graph: ", why, "; steps run eagerly from here");
  graph_.reset();
  pool_.reset();
  if (block_) rep_.pool().deallocate(block_);  // stream-ordered: after the replays queued before
  block_ = nullptr;
}

bool StepGraph::begin_step() {
  if (measuring_) {  // the last warm-up step threw before end_eager()
    rep_.pool().pop_scope();
    measuring_ = false;
  }
  if (!off_.empty()) return false;
  if (eager_ < kWarmupSteps) {  // cuDNN chooses, the scratch grows, the peak is measured
    rep_.pool().push_scope();
    measuring_ = true;
    return false;
  }
  return true;
}

void StepGraph::end_eager() {
  if (!measuring_) return;
  measuring_ = false;
  peak_ = std::max(peak_, rep_.pool().pop_scope().peak_delta());
  ++eager_;
}

bool StepGraph::stage(int k, const Tensor& images, const Tensor& labels) {
  if (k < 0 || k >= micro_steps_)
    throw Error("StepGraph: micro-batch " + std::to_string(k) + " of a step of " + std::to_string(micro_steps_));
  if (slots_.empty()) slots_.resize(static_cast<size_t>(micro_steps_));
  auto& [im, lb] = slots_[static_cast<size_t>(k)];
  if (!im.defined()) {  // the first deferred step's shapes are the graph's
    im = Tensor::empty(rep_.pool(), images.shape(), images.dtype(), MemTag::other);
    lb = Tensor::empty(rep_.pool(), labels.shape(), labels.dtype(), MemTag::other);
  }
  if (images.shape() != im.shape() || images.dtype() != im.dtype() || labels.shape() != lb.shape() ||
      labels.dtype() != lb.dtype())
    return false;
  copy_tensor(images, im, &rep_.stream());
  copy_tensor(labels, lb, &rep_.stream());
  return true;
}

bool StepGraph::run(const Body& body) {
  if (!off_.empty()) {
    body(rep_.pool(), slots_);
    return true;
  }
  try {  // nothing of this step has run when it throws: it then runs eagerly, once
    if (current_stream() != &rep_.stream()) throw Error("the replica's work does not go to its compute stream");
    if (!pool_) {
      // The eager steps' peak with a margin: the captured step allocates in the same order, and a
      // shortfall fails the capture (graphs off), never the run.
      const size_t want = peak_ + peak_ / 4 + (size_t(64) << 20);
      block_bytes_ = (want + MemoryPool::kGranularity - 1) / MemoryPool::kGranularity * MemoryPool::kGranularity;
      block_ = rep_.pool().allocate(block_bytes_, MemTag::other);
      PoolOptions po;
      po.mode = AllocatorMode::preallocate;
      po.bytes = block_bytes_;
      pool_ = std::make_unique<MemoryPool>(
          rep_.device(), std::make_unique<BlockUpstream>(block_, block_bytes_, "train.cuda_graph's private pool"), po);
    }
    if (!graph_ || epoch_ != ops::backend_for(rep_.device()).capture_epoch()) capture(body);
  } catch (const std::exception& err) {
    turn_off(std::string("no graph: ") + err.what());
    body(rep_.pool(), slots_);
    return true;
  }
  if (verify_ && !checked_) return check(body);
  graph_->launch(rep_.stream());
  ++replays_;
  return false;
}

void StepGraph::capture(const Body& body) {
  auto& be = ops::backend_for(rep_.device());
  const uint64_t epoch = be.capture_epoch();
  graph_.reset();
  auto g = capture_work(rep_.device(), rep_.pool());
  g->begin(rep_.stream());
  try {
    body(*pool_, slots_);
    g->end();
  } catch (...) {
    g->abandon();
    if (opt_.pending()) opt_.settle(false);  // the captured update never ran
    throw;
  }
  // The captured update is queued by the launch that follows; the optimizer waits for settle().
  if (const size_t kept = pool_->stats().in_use) {
    if (opt_.pending()) opt_.settle(false);
    throw Error("the captured step kept " + format_bytes(kept) + " of its private pool after it ended");
  }
  if (be.capture_epoch() != epoch) {
    if (opt_.pending()) opt_.settle(false);
    throw Error("the backend's scratch moved during the capture");
  }
  nodes_ = g->nodes();
  graph_ = std::move(g);
  epoch_ = epoch;
  if (captures_++ == 0)
    log_info("train.cuda_graph: the training step captured as one ",
             rep_.device().kind == DeviceKind::cuda ? "CUDA graph of " : "recording of ", nodes_,
             rep_.device().kind == DeviceKind::cuda ? " nodes" : " backend calls", " (private pool ",
             format_bytes(block_bytes_), "), replayed from here");
}

std::vector<Tensor> StepGraph::state() {
  std::vector<Tensor> s = {model_.params(), model_.grads(), model_.buffers(), stats_};
  if (model_.compute_copy().defined()) s.push_back(model_.compute_copy());
  for (Tensor* t : opt_.state()) s.push_back(*t);
  return s;
}

// The first replay against an eager step from the same state: the eager step runs, its results
// are kept, the state is put back, the graph replays, and the two are compared on the host (once).
bool StepGraph::check(const Body& body) {
  checked_ = true;
  static const char* const kNames[] = {"parameters", "gradients", "batch-norm running statistics", "the step's scalars"};
  auto name = [&](size_t i) {
    if (i < 4) return std::string(kNames[i]);
    const bool copy = model_.compute_copy().defined();
    return copy && i == 4 ? std::string("the 16-bit compute copy") : "optimizer state " + std::to_string(i - (copy ? 5 : 4));
  };
  auto keep = [&](const Tensor& t) {
    Tensor c = Tensor::empty(rep_.pool(), t.shape(), t.dtype(), MemTag::other);
    copy_tensor(t, c, &rep_.stream());
    return c;
  };
  const std::vector<Tensor> live = state();
  std::vector<Tensor> before, eager;
  for (const Tensor& t : live) before.push_back(keep(t));
  if (opt_.pending()) opt_.settle(false);  // the capture's update, not run: the eager step queues it
  body(rep_.pool(), slots_);
  for (const Tensor& t : live) eager.push_back(keep(t));
  for (size_t i = 0; i < live.size(); ++i) copy_tensor(before[i], live[i], &rep_.stream());
  graph_->launch(rep_.stream());  // the same step again, from the same state, as the graph has it
  ++replays_;
  std::string diff;
  for (size_t i = 0; i < live.size(); ++i) diff += compare(name(i), eager[i], live[i], deterministic_);
  if (diff.empty()) {
    log_info("train.cuda_graph: the first replay matches an eager step from the same state (",
             deterministic_ ? "bit for bit" : "within 1e-3", ")");
    return true;
  }
  for (size_t i = 0; i < live.size(); ++i) copy_tensor(eager[i], live[i], &rep_.stream());  // the eager step stands
  turn_off("the first replay differs from an eager step from the same state (" + diff.substr(0, diff.size() - 2) + ")");
  return true;
}

std::string StepGraph::summary() const {
  if (!off_.empty()) return "train.cuda_graph off after " + std::to_string(replays_) + " replays: " + off_;
  if (!captures_) return "train.cuda_graph: no step was captured (the run ended within the warm-up)";
  return "train.cuda_graph: " + std::to_string(replays_) + " steps replayed from " + std::to_string(captures_) +
         " capture(s) (" + std::to_string(nodes_) +
         (rep_.device().kind == DeviceKind::cuda ? " nodes" : " recorded calls") + "), private pool " +
         format_bytes(block_bytes_);
}

}  // namespace replica::train
