// StepGraph: the whole training step captured as a CUDA graph and replayed (train.cuda_graph).
#include "train/step_graph.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/errors.h"
#include "core/log.h"
#include "core/units.h"
#include "ops/backend.h"
#include "parallel/capture_holds.h"

namespace replica::train {

namespace {
// "" when `x` (eager) and `y` (replayed), the bytes of one `dt` buffer, agree: every bit, or (not
// exact) each element within 1e-3 of x's largest magnitude or, in 16 bits, within one step of its
// own value: a compute copy rounds parameters that cuDNN's non-deterministic algorithms move in
// their last f32 bits, and such a move flips a rounding now and then.
std::string compare(const std::string& what, DType dt, const std::string& x, const std::string& y, bool exact) {
  if (x == y) return "";
  const bool floats = dt == DType::f32 || dt == DType::f16 || dt == DType::bf16;
  if (!floats || x.size() != y.size()) return what + " differ; ";
  const size_t n = x.size() / dtype_size(dt);
  std::vector<float> u(n), v(n);
  convert(x.data(), dt, u.data(), DType::f32, n);
  convert(y.data(), dt, v.data(), DType::f32, n);
  const double step = dt == DType::bf16 ? 0x1p-7 : dt == DType::f16 ? 0x1p-10 : 0.0;  // relative, at most
  double largest = 0;
  for (float a : u) largest = std::max(largest, std::abs(static_cast<double>(a)));
  double diff = 0;
  int64_t differing = 0, beyond = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = std::abs(static_cast<double>(u[i]) - v[i]);
    if (d == 0) continue;
    ++differing;  // NaN against a number counts
    diff = std::isnan(d) ? INFINITY : std::max(diff, d);
    if (!(d <= 1e-3 * largest || d <= step * std::abs(static_cast<double>(u[i])))) ++beyond;
  }
  if (!exact && beyond == 0) return "";
  return what + ": " + std::to_string(differing) + " of " + std::to_string(n) + " elements differ, by up to " +
         std::to_string(diff / std::max(largest, 1e-30)) + " of the largest; ";
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
      deterministic_(deterministic) {
  if (rep_.world() == 1) return;
  // The group's abort (any thread) or end releases the graph before the collectives it holds.
  const auto release = [this] {
    std::lock_guard<std::mutex> lock(graph_m_);
    released_ = true;
    if (rep_.device().kind == DeviceKind::cuda) graph_.reset();  // NCCL's plans in it go with it
  };
  for (parallel::Communicator* c : {&rep_.comm(), rep_.has_lane() ? &rep_.lane() : nullptr}) {
    parallel::CaptureHolds* h = c ? c->capture_holds() : nullptr;
    if (!h || (!holds_.empty() && holds_.back().first == h)) continue;
    const int id = h->hold(release);
    if (id >= 0) holds_.emplace_back(h, id);
  }
}

StepGraph::~StepGraph() {
  for (auto& [h, id] : holds_) h->drop(id);  // waits for a release in progress
  graph_.reset();
  pool_.reset();
  if (block_) rep_.pool().deallocate(block_);
}

bool StepGraph::released() const {
  std::lock_guard<std::mutex> lock(graph_m_);
  return released_;
}

void StepGraph::launch_graph() {
  std::unique_lock<std::mutex> lock(graph_m_);
  if (released_ || !graph_)
    throw CommError("train.cuda_graph: the replica group's collectives were aborted, and the captured step "
                              "holding them released");
  if (rep_.device().kind == DeviceKind::cuda) return graph_->launch(rep_.stream());  // queued: a moment's lock
  lock.unlock();  // a CPU replay runs the recorded collectives here, waiting for the peers
  graph_->launch(rep_.stream());
}

void StepGraph::turn_off(const std::string& why) {
  off_ = why;
  log_warn("train.cuda_graph: ", why, "; steps run eagerly from here");
  {
    std::lock_guard<std::mutex> lock(graph_m_);
    graph_.reset();
  }
  pool_.reset();
  if (block_) rep_.pool().deallocate(block_);  // stream-ordered: after the replays queued before
  block_ = nullptr;
}

bool StepGraph::begin_step(bool ready) {
  held_.clear();  // a step that threw before run() left its micro-batches
  if (measuring_) {  // the last warm-up step threw before end_eager()
    rep_.pool().pop_scope();
    measuring_ = false;
  }
  if (!off_.empty()) return false;
  if (eager_ < kWarmupSteps || !ready) {  // cuDNN chooses, the scratch grows, the peak is measured
    rep_.pool().push_scope();
    measuring_ = true;
    return false;
  }
  return true;
}

void StepGraph::end_eager() {
  if (!measuring_) return;
  measuring_ = false;
  const size_t peak = rep_.pool().pop_scope().peak_delta();
  // The first step's peak holds what a step needs once (cuDNN's algorithm search takes up to
  // REPLICA_CUDNN_WORKSPACE_MB to time its candidates; the backend's first scratch): the private
  // pool is sized from the steps after it, which the captured step repeats.
  if (eager_ > 0 || kWarmupSteps == 1) peak_ = std::max(peak_, peak);
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
  const bool fits = held_.empty() && images.shape() == im.shape() && images.dtype() == im.dtype() &&
                    labels.shape() == lb.shape() && labels.dtype() == lb.dtype();
  if (fits) {
    copy_tensor(images, im, &rep_.stream());
    copy_tensor(labels, lb, &rep_.stream());
    return true;
  }
  if (rep_.world() == 1) return false;
  // With peers this replica cannot decide alone to run eagerly (its collectives would meet the
  // peers' captured ones): the step's micro-batches are kept (copies: the loader reuses its
  // buffers) and run() agrees on an eager step for every replica.
  auto keep = [&](const Tensor& t) {
    Tensor c = Tensor::empty(rep_.pool(), t.shape(), t.dtype(), MemTag::data);
    copy_tensor(t, c, &rep_.stream());
    return c;
  };
  if (held_.empty())
    for (int j = 0; j < k; ++j) held_.emplace_back(keep(slots_[j].first), keep(slots_[j].second));
  held_.emplace_back(keep(images), keep(labels));
  return true;
}

int StepGraph::agree_plan(int mine) {
  if (rep_.world() == 1) return mine;
  const float f = static_cast<float>(mine);
  const std::vector<float> all = rep_.all_gather(&f, 1);
  int plan = 0;
  size_t who = 0;
  for (size_t r = 0; r < all.size(); ++r)
    if (static_cast<int>(all[r]) > plan) plan = static_cast<int>(all[r]), who = r;
  if (plan == 2 && !said_eager_) {  // once: it is the rare step (a data set's last, short batch)
    said_eager_ = true;
    log_info("train.cuda_graph: replica ", who, "'s micro-batches do not fit the captured step's input slots; every "
             "replica runs such a step eagerly");
  }
  return plan;
}

std::string StepGraph::agree(const std::string& mine, const char* what) {
  if (rep_.world() == 1) return mine;
  const float failed = mine.empty() ? 0.f : 1.f;
  const std::vector<float> all = rep_.all_gather(&failed, 1);  // every replica, whatever it found
  if (!mine.empty()) return mine;
  for (size_t r = 0; r < all.size(); ++r)
    if (all[r] != 0.f) return "replica " + std::to_string(r) + " " + what;
  return "";
}

bool StepGraph::run(const Body& body) {
  struct Clear {  // the kept micro-batches serve this step only
    Inputs& held;
    ~Clear() { held.clear(); }
  } clear{held_};
  if (!off_.empty()) {
    body(rep_.pool(), eager_inputs());
    return true;
  }
  // This replica's way, agreed with the peers: an eager step when one kept its micro-batches, a
  // capture when one has no graph for the backend's scratch as it is now, else a replay.
  bool fresh;
  {
    std::lock_guard<std::mutex> lock(graph_m_);
    fresh = graph_ && epoch_ == ops::backend_for(rep_.device()).capture_epoch();
  }
  const int plan = agree_plan(!held_.empty() ? 2 : fresh ? 0 : 1);
  if (plan == 2) {
    body(rep_.pool(), eager_inputs());
    return true;
  }
  if (plan == 1) {
    std::string failed;
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
      capture(body);
    } catch (const std::exception& err) {
      failed = err.what();
      if (failed.empty()) failed = "capturing failed";
    }
    // Every capture is agreed (auto's check runs the step twice, an eager step once, and the
    // collectives of every replica must pair): one replica's failure turns graphs off on all.
    failed = agree(failed, "could not capture its step");
    if (!failed.empty()) {
      turn_off("no graph: " + failed);
      body(rep_.pool(), slots_);
      return true;
    }
  }
  if (verify_ && !checked_) return check(body);
  launch_graph();
  ++replays_;
  return false;
}

void StepGraph::capture(const Body& body) {
  auto& be = ops::backend_for(rep_.device());
  const uint64_t epoch = be.capture_epoch();
  {
    std::lock_guard<std::mutex> lock(graph_m_);
    graph_.reset();
  }
  auto g = capture_work(rep_.device(), rep_.pool());
  // A block the captured work took from the replica's pool would be written by every replay after
  // the pool handed it to someone else: everything the step allocates must come from the private pool.
  const ThreadAllocationCount taken(rep_.pool());  // this thread's: a loader's threads may allocate there
  g->begin(rep_.stream());
  try {
    body(*pool_, slots_);
    if (const size_t n = taken.count())
      throw Error("the captured step took " + std::to_string(n) +
                  " block(s) from the replica's pool, which replays would write after it handed them on");
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
  {
    std::lock_guard<std::mutex> lock(graph_m_);
    if (released_) throw CommError("the replica group's collectives were aborted during the capture");
    graph_ = std::move(g);
  }
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

// The first replay against an eager step from the same state: the state is kept on the host, the
// eager step runs in the graph's own pool (the eager peak and more: the check needs no device memory
// beyond what the graph has), its results are kept, the state is put back, the graph replays, and
// the two are compared on the host (once). A failure of the eager step (out of memory, say) puts
// the state back, turns graphs off and runs the step eagerly in the replica's pool.
bool StepGraph::check(const Body& body) {
  checked_ = true;
  static const char* const kNames[] = {"parameters", "gradients", "batch-norm running statistics", "the step's scalars"};
  auto name = [&](size_t i) {
    if (i < 4) return std::string(kNames[i]);
    const bool copy = model_.compute_copy().defined();
    return copy && i == 4 ? std::string("the 16-bit compute copy") : "optimizer state " + std::to_string(i - (copy ? 5 : 4));
  };
  const std::vector<Tensor> live = state();
  std::vector<std::string> before, eager;
  for (const Tensor& t : live) before.push_back(tensor_to_bytes(t));
  auto restore = [&](const std::vector<std::string>& from) {
    for (size_t i = 0; i < live.size(); ++i) tensor_from_bytes(live[i], from[i].data(), from[i].size());
  };
  if (opt_.pending()) opt_.settle(false);  // the capture's update, not run: the eager step queues it
  try {
    body(*pool_, slots_);
    for (const Tensor& t : live) eager.push_back(tensor_to_bytes(t));
  } catch (const std::exception& err) {
    if (opt_.pending()) opt_.settle(false);
    restore(before);
    if (rep_.world() > 1) throw;  // its peers wait on this step's collectives: the group stops
    turn_off(std::string("the first replay could not be checked: ") + err.what());
    body(rep_.pool(), slots_);
    return true;
  }
  restore(before);
  launch_graph();  // the same step again, from the same state, as the graph has it
  ++replays_;
  std::string diff;
  for (size_t i = 0; i < live.size(); ++i)
    diff += compare(name(i), live[i].dtype(), eager[i], tensor_to_bytes(live[i]), deterministic_);
  const std::string why = agree(
      diff.empty() ? "" : "the first replay differs from an eager step from the same state (" +
                              diff.substr(0, diff.size() - 2) + ")",
      "found that its first replay differs from an eager step from the same state");
  if (why.empty()) {
    log_info("train.cuda_graph: the first replay matches an eager step from the same state (",
             deterministic_ ? "bit for bit" : "within 1e-3", ")");
    return true;
  }
  restore(eager);  // the eager step stands (on every replica: their eager steps reduced together)
  turn_off(why);
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
