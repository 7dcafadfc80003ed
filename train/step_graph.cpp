// StepGraph: the micro-step captured as a CUDA graph and replayed (train.cuda_graph).
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
constexpr size_t kGraphsKept = 4;  // loss weights: the fp16 scale halves on overflow, grows rarely

// "" when `a` (eager) and `b` (replayed) agree: every bit, or within 1e-3 of a's largest magnitude.
std::string compare(const char* what, const Tensor& a, const Tensor& b, bool exact) {
  const std::string x = tensor_to_bytes(a), y = tensor_to_bytes(b);
  if (x == y) return "";
  if (a.dtype() != DType::f32) return std::string(what) + " differ; ";
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
  return std::string(what) + ": " + std::to_string(differing) + " of " + std::to_string(u.size()) +
         " elements differ, by up to " + std::to_string(rel) + " of the largest; ";
}
}  // namespace

StepGraph::StepGraph(parallel::Replica& replica, nn::Model& model, Tensor stats, bool verify, bool deterministic)
    : rep_(replica), model_(model), stats_(std::move(stats)), verify_(verify), deterministic_(deterministic) {}

StepGraph::~StepGraph() {
  cache_.clear();
  pool_.reset();
  if (block_) rep_.pool().deallocate(block_);
}

void StepGraph::turn_off(const std::string& why) {
  off_ = why;
  log_warn("train.cuda_graph: ", why, "; the step runs eagerly from here");
  cache_.clear();
  pool_.reset();
  if (block_) rep_.pool().deallocate(block_);  // stream-ordered: after the replays queued before
  block_ = nullptr;
  images_ = Tensor();
  labels_ = Tensor();
}

void StepGraph::run(const Tensor& images, const Tensor& labels, float weight, const Pass& pass) {
  if (!off_.empty()) return pass(rep_.pool(), images, labels);
  if (eager_ < kWarmupPasses) {  // cuDNN chooses, the scratch grows, the peak is measured
    rep_.pool().push_scope();
    try {
      pass(rep_.pool(), images, labels);
    } catch (...) {
      rep_.pool().pop_scope();
      throw;
    }
    peak_ = std::max(peak_, rep_.pool().pop_scope().peak_delta());
    ++eager_;
    return;
  }
  Entry* e = nullptr;
  bool same_shape = true;
  try {  // nothing of this micro-step has run when it throws: it then runs eagerly, once
    if (current_stream() != &rep_.stream()) throw Error("the replica's work does not go to its compute stream");
    same_shape = prepare(images, labels);
    if (same_shape) {
      const uint64_t epoch = ops::backend_for(rep_.device()).capture_epoch();
      for (auto& c : cache_)
        if (c.weight == weight && c.epoch == epoch) e = &c;
      if (!e) e = &capture(weight, pass);
    }
  } catch (const std::exception& err) {
    turn_off(std::string("no graph: ") + err.what());
    return pass(rep_.pool(), images, labels);
  }
  if (!same_shape) return pass(rep_.pool(), images, labels);  // a batch of another shape: eager
  if (verify_ && !checked_) return check(*e, images, labels, pass);
  e->graph->launch(rep_.stream());
  ++replays_;
}

// The private pool and the fixed inputs, the first time; then this micro-batch copied in (false:
// a batch of another shape, which runs eagerly).
bool StepGraph::prepare(const Tensor& images, const Tensor& labels) {
  if (!pool_) {
    // The eager passes' peak with a margin: the captured pass allocates in the same order, and a
    // shortfall fails the capture (graphs off), never the run.
    const size_t want = peak_ + peak_ / 4 + (size_t(64) << 20);
    block_bytes_ = (want + MemoryPool::kGranularity - 1) / MemoryPool::kGranularity * MemoryPool::kGranularity;
    block_ = rep_.pool().allocate(block_bytes_, MemTag::other);
    PoolOptions po;
    po.mode = AllocatorMode::preallocate;
    po.bytes = block_bytes_;
    pool_ = std::make_unique<MemoryPool>(
        rep_.device(), std::make_unique<BlockUpstream>(block_, block_bytes_, "train.cuda_graph's private pool"), po);
    images_ = Tensor::empty(rep_.pool(), images.shape(), images.dtype(), MemTag::other);
    labels_ = Tensor::empty(rep_.pool(), labels.shape(), labels.dtype(), MemTag::other);
  }
  if (images.shape() != images_.shape() || images.dtype() != images_.dtype() || labels.shape() != labels_.shape() ||
      labels.dtype() != labels_.dtype())
    return false;
  copy_tensor(images, images_, &rep_.stream());
  copy_tensor(labels, labels_, &rep_.stream());
  return true;
}

StepGraph::Entry& StepGraph::capture(float weight, const Pass& pass) {
  auto& be = ops::backend_for(rep_.device());
  const uint64_t epoch = be.capture_epoch();
  auto g = std::make_unique<cuda::CapturedGraph>();
  g->begin(rep_.stream());
  try {
    pass(*pool_, images_, labels_);
    g->end();
  } catch (...) {
    g->abandon();
    throw;
  }
  if (const size_t kept = pool_->stats().in_use)
    throw Error("the captured pass kept " + format_bytes(kept) + " of its private pool after it ended");
  if (be.capture_epoch() != epoch) throw Error("the backend's scratch moved during the capture");
  if (cache_.size() >= kGraphsKept) cache_.erase(cache_.begin());
  nodes_ = g->nodes();
  cache_.push_back({weight, epoch, std::move(g)});
  if (captures_++ == 0)
    log_info("train.cuda_graph: the micro-step captured as one CUDA graph of ", nodes_, " nodes (private pool ",
             format_bytes(block_bytes_), "), replayed from here");
  return cache_.back();
}

// The first replay against an eager pass from the same state: the eager pass runs, its results
// are kept, the state is put back, the graph replays, and the two are compared on the host (once).
void StepGraph::check(Entry& e, const Tensor& images, const Tensor& labels, const Pass& pass) {
  checked_ = true;
  Tensor& grads = model_.grads();
  Tensor& bufs = model_.buffers();
  auto keep = [&](const Tensor& t) {
    Tensor c = Tensor::empty(rep_.pool(), t.shape(), t.dtype(), MemTag::other);
    copy_tensor(t, c, &rep_.stream());
    return c;
  };
  const Tensor g0 = keep(grads), b0 = keep(bufs), s0 = keep(stats_);
  pass(rep_.pool(), images, labels);
  const Tensor ge = keep(grads), be = keep(bufs), se = keep(stats_);
  copy_tensor(g0, grads, &rep_.stream());
  copy_tensor(b0, bufs, &rep_.stream());
  copy_tensor(s0, stats_, &rep_.stream());
  e.graph->launch(rep_.stream());
  ++replays_;
  const std::string diff = compare("gradients", ge, grads, deterministic_) +
                           compare("batch-norm running statistics", be, bufs, deterministic_) +
                           compare("loss sums", se, stats_, deterministic_);
  if (diff.empty()) {
    log_info("train.cuda_graph: the first replay matches an eager pass from the same state (",
             deterministic_ ? "bit for bit" : "within 1e-3", ")");
    return;
  }
  copy_tensor(ge, grads, &rep_.stream());  // the eager results stand
  copy_tensor(be, bufs, &rep_.stream());
  copy_tensor(se, stats_, &rep_.stream());
  turn_off("the first replay differs from an eager pass from the same state (" + diff.substr(0, diff.size() - 2) + ")");
}

std::string StepGraph::summary() const {
  if (!off_.empty()) return "train.cuda_graph off after " + std::to_string(replays_) + " replays: " + off_;
  if (!captures_) return "train.cuda_graph: no micro-step was captured (the run ended within the warm-up)";
  return "train.cuda_graph: " + std::to_string(replays_) + " micro-steps replayed from " + std::to_string(captures_) +
         " capture(s) (" + std::to_string(nodes_) + " nodes), private pool " + format_bytes(block_bytes_);
}

}  // namespace replica::train
