// GradientSync: bucket layout, readiness counting, launch and wait; replica agreement checks.
#include "parallel/gradient_sync.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/checksum.h"
#include "core/errors.h"

namespace replica::parallel {

GradientSync::GradientSync(const std::vector<int64_t>& offsets, Tensor grads, Communicator& comm,
                           BucketOptions o)
    : offsets_(offsets), o_(std::move(o)), grads_(std::move(grads)), comm_(comm) {
  const int n = static_cast<int>(offsets.size());
  marked_.assign(n, false);
  for (int s = 1; s < n; ++s)
    if (offsets[s] < offsets[s - 1])
      throw Error("GradientSync: slot offsets must increase (slot " + std::to_string(s) + " starts at " +
                  std::to_string(offsets[s]) + ", before slot " + std::to_string(s - 1) + ")");
  total_ = grads_.numel();
  if (o_.release) {
    const int rank = shard_rank();
    if (o_.shard.size() < 2 || rank + 1 >= static_cast<int>(o_.shard.size()) || !o_.bind)
      throw Error("GradientSync: releasing gradients needs the shard bounds, this rank's place in them and a bind");
    total_ = o_.shard.back();
    const int64_t mine = o_.shard[rank + 1] - o_.shard[rank];
    if (grads_.numel() != std::max<int64_t>(mine, 1))
      throw Error("GradientSync: the shard buffer holds " + std::to_string(grads_.numel()) + " elements; rank " +
                  std::to_string(rank) + " owns " + std::to_string(mine));
  }
  // Reverse parameter order at first: the last layers finish backward first.
  std::vector<int> reverse(n);
  for (int s = 0; s < n; ++s) reverse[s] = n - 1 - s;
  cut(reverse);
  if (o_.wire != DType::f32) {
    if (o_.wire != DType::f16 && o_.wire != DType::bf16)
      throw ConfigError("parallel.grad_dtype: gradients travel as fp32, fp16 or bf16");
    if (!o_.staging_pool) throw Error("GradientSync: a 16-bit wire dtype needs a staging pool");
    // Released buckets round into a buffer of their own for as long as they travel.
    if (!o_.release) staging_ = Tensor::empty(*o_.staging_pool, grads_.shape(), o_.wire, MemTag::comm);
    cast_ = o_.cast ? o_.cast : [](const Tensor& a, const Tensor& b) {
      convert(a.raw(), a.dtype(), b.raw(), b.dtype(), static_cast<size_t>(a.numel()));
    };
  }
}

std::vector<int64_t> initial_bucket_edges(const std::vector<int64_t>& offsets, int64_t total, const BucketOptions& o) {
  // The reverse-order cut of GradientSync::cut, as edges: buckets there are contiguous ranges.
  const double wire_bytes = static_cast<double>(dtype_size(o.wire));
  double cap = o.first_bucket_mb * 1048576.0;
  std::vector<int64_t> edges{total};
  int64_t elements = 0;
  for (int s = static_cast<int>(offsets.size()) - 1; s >= 0; --s) {
    if (elements > 0 && static_cast<double>(elements) * wire_bytes >= cap) {
      edges.push_back(offsets[s + 1]);
      cap = o.bucket_mb * 1048576.0;
      elements = 0;
    }
    elements += (s + 1 < static_cast<int>(offsets.size()) ? offsets[s + 1] : total) - offsets[s];
  }
  edges.push_back(0);
  std::sort(edges.begin(), edges.end());
  return edges;
}

void GradientSync::cut(const std::vector<int>& order) {
  const int n = static_cast<int>(offsets_.size());
  const int64_t total = total_;
  // Bucket sizes count the bytes that travel: 2 per element on a 16-bit wire, 4 in f32.
  const double wire_bytes = static_cast<double>(dtype_size(o_.wire));
  double cap = o_.first_bucket_mb * 1048576.0;
  buckets_.clear();
  bucket_of_slot_.assign(n, -1);
  std::vector<std::vector<int>> members;
  for (int s : order) {
    if (members.empty() || static_cast<double>(buckets_.back().elements) * wire_bytes >= cap) {
      if (!members.empty()) cap = o_.bucket_mb * 1048576.0;
      buckets_.emplace_back();
      members.emplace_back();
    }
    buckets_.back().elements += (s + 1 < n ? offsets_[s + 1] : total) - offsets_[s];
    buckets_.back().slots++;
    members.back().push_back(s);
    bucket_of_slot_[s] = static_cast<int>(buckets_.size()) - 1;
  }
  for (size_t k = 0; k < buckets_.size(); ++k) {
    auto& b = buckets_[k];
    std::sort(members[k].begin(), members[k].end());
    b.members = members[k];
    for (int s : members[k]) {
      const int64_t lo = offsets_[s], hi = s + 1 < n ? offsets_[s + 1] : total;
      if (!b.ranges.empty() && b.ranges.back().second == lo) b.ranges.back().second = hi;
      else b.ranges.push_back({lo, hi});
    }
    b.lo = b.ranges.front().first;
    b.hi = b.ranges.back().second;
    // Not neighbours in memory: gathered into a buffer of their own (release mode's storage is
    // packed already).
    if (b.ranges.size() > 1 && !o_.release) {
      MemoryPool* pool = o_.staging_pool ? o_.staging_pool : grads_.pool();
      b.packed = Tensor::empty(*pool, {b.elements}, o_.wire, MemTag::comm);
    }
  }
}

void GradientSync::rebuild() {
  rebuild_pending_ = false;
  const int n = static_cast<int>(offsets_.size());
  // Every rank must cut the same buckets: rank 0's order travels (exact in f32 below 2^24 slots).
  std::vector<float> order(observed_.begin(), observed_.end());
  broadcast_host(comm_, grads_.pool(), order.data(), order.size(), 0);
  std::vector<int> slots(n);
  for (int i = 0; i < n; ++i) slots[i] = static_cast<int>(order[i]);
  zero();  // nothing is held between steps; the slots are bound again to the new buckets
  observed_.clear();
  observed_.shrink_to_fit();
  rebuild_done_ = true;
  // Nothing to do when the observed order cuts the same buckets (the usual reverse order).
  const std::vector<int> before = bucket_of_slot_;
  cut(slots);
  if (bucket_of_slot_ != before) rebuilds_++;
}

void GradientSync::begin(bool sync) {
  if (rebuild_pending_) rebuild();
  observed_.clear();
  sync_ = sync;
  launched_early_ = 0;
  next_launch_ = 0;
  next_complete_ = 0;
  marked_.assign(bucket_of_slot_.size(), false);
  for (auto& b : buckets_) {
    b.pending = b.slots;
    b.work = nullptr;
  }
}

namespace {
int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

void GradientSync::launch(Bucket& b) {
  b.launched_ns = steady_ns();
  if (o_.release) {
    if (!b.storage.defined()) take(b);  // no slot of it got a gradient this pass: zeros
    void* data = b.storage.raw();
    DType dt = DType::f32;
    if (o_.wire != DType::f32) {  // the rounded copy travels; the f32 one can go at once
      b.wire = Tensor::empty(*o_.staging_pool, {b.elements}, o_.wire, MemTag::comm);
      cast_(b.storage, b.wire);
      give_back(b);
      data = b.wire.raw();
      dt = o_.wire;
    }
    std::vector<size_t> within;
    for (int64_t e : o_.shard) within.push_back(static_cast<size_t>(packed_position(b, e)));
    b.work = comm_.reduce_scatter_v_async(data, static_cast<size_t>(b.elements), dt, ReduceOp::avg, within);
    return;
  }
  if (b.packed.defined()) {  // gather the ranges (cast to the wire dtype on the way), reduce, scatter in finish()
    int64_t at = 0;
    for (auto [lo, hi] : b.ranges) {
      const Tensor src = grads_.view(lo, {hi - lo}), dst = b.packed.view(at, {hi - lo});
      if (staging_.defined()) cast_(src, dst);
      else copy_tensor(src, dst);
      at += hi - lo;
    }
    b.work = comm_.all_reduce_async(b.packed.raw(), static_cast<size_t>(b.elements), b.packed.dtype(), ReduceOp::avg);
    return;
  }
  const size_t n = static_cast<size_t>(b.hi - b.lo);
  void* data = grads_.data<float>() + b.lo;
  DType dt = DType::f32;
  if (staging_.defined()) {
    const size_t es = dtype_size(staging_.dtype());
    data = static_cast<char*>(staging_.raw()) + static_cast<size_t>(b.lo) * es;
    dt = staging_.dtype();
    cast_(grads_.view(b.lo, {b.hi - b.lo}), staging_.view(b.lo, {b.hi - b.lo}));
  }
  if (!o_.shard.empty()) {  // ZeRO-2: each rank receives its own part of the bucket
    std::vector<size_t> within;
    for (int64_t e : o_.shard) within.push_back(static_cast<size_t>(std::clamp(e, b.lo, b.hi) - b.lo));
    b.work = comm_.reduce_scatter_v_async(data, n, dt, ReduceOp::avg, within);
    return;
  }
  b.work = comm_.all_reduce_async(data, n, dt, ReduceOp::avg);
}

void GradientSync::unpack(Bucket& b) {
  if (b.packed.defined()) {
    int64_t at = 0;
    for (auto [lo, hi] : b.ranges) {
      const Tensor src = b.packed.view(at, {hi - lo}), dst = grads_.view(lo, {hi - lo});
      if (staging_.defined()) cast_(src, dst);
      else copy_tensor(src, dst);
      at += hi - lo;
    }
  } else if (staging_.defined()) {
    int64_t lo = b.lo, hi = b.hi;
    if (!o_.shard.empty()) {  // only this rank's part was reduced
      lo = std::clamp(o_.shard[comm_.rank()], b.lo, b.hi);
      hi = std::clamp(o_.shard[comm_.rank() + 1], b.lo, b.hi);
    }
    if (hi > lo) cast_(staging_.view(lo, {hi - lo}), grads_.view(lo, {hi - lo}));
  }
}

int64_t GradientSync::packed_position(const Bucket& b, int64_t flat) const {
  int64_t at = 0;
  for (auto [lo, hi] : b.ranges) {
    if (flat <= lo) break;
    at += std::min(flat, hi) - lo;
  }
  return at;
}

void GradientSync::take(Bucket& b) {
  b.storage = Tensor::zeros(*grads_.pool(), {b.elements}, DType::f32, MemTag::grads);
  int64_t at = 0;  // the members in slot order are the ranges in order
  for (int s : b.members) {
    const int64_t n = (s + 1 < static_cast<int>(offsets_.size()) ? offsets_[s + 1] : total_) - offsets_[s];
    o_.bind(s, b.storage.view(at, {n}));
    at += n;
  }
}

void GradientSync::give_back(Bucket& b) {
  if (!b.storage.defined()) return;
  for (int s : b.members) o_.bind(s, Tensor());
  b.storage = Tensor();
}

// This rank's part of the reduced bucket, range by range, into its shard; then the bucket goes.
void GradientSync::complete(Bucket& b) {
  if (!b.storage.defined() && !b.wire.defined()) take(b);  // one replica: nothing travelled
  const Tensor& from = b.wire.defined() ? b.wire : b.storage;
  const int rank = shard_rank();
  const int64_t mine_lo = o_.shard[rank], mine_hi = o_.shard[rank + 1];
  int64_t at = 0;
  for (auto [lo, hi] : b.ranges) {
    const int64_t a = std::max(lo, mine_lo), e = std::min(hi, mine_hi);
    if (a < e) {
      const Tensor src = from.view(at + (a - lo), {e - a}), dst = grads_.view(a - mine_lo, {e - a});
      if (from.dtype() != DType::f32) cast_(src, dst);
      else copy_tensor(src, dst);
    }
    at += hi - lo;
  }
  give_back(b);
  b.wire = Tensor();
}

void GradientSync::prepare(int first, int count) {
  if (!o_.release) return;
  for (int s = first; s < first + count; ++s) {
    Bucket& b = buckets_.at(static_cast<size_t>(bucket_of_slot_.at(static_cast<size_t>(s))));
    if (!b.storage.defined()) take(b);
  }
}

void GradientSync::zero() {
  for (auto& b : buckets_) {
    give_back(b);
    b.wire = Tensor();
  }
}

int64_t GradientSync::held_elements() const {
  int64_t n = 0;
  for (const auto& b : buckets_) n += b.storage.defined() ? b.elements : 0;
  return n;
}

void GradientSync::ready(int first, int count) {
  // The reducer's invariants (as PyTorch's REDUCER_CHECK): every slot is reported once per pass,
  // and only slots that exist; anything else would reduce a bucket early or never.
  const int n = static_cast<int>(bucket_of_slot_.size());
  if (first < 0 || count < 0 || first + count > n)
    throw Error("GradientSync: slots [" + std::to_string(first) + ", " + std::to_string(first + count) +
                ") reported ready, but there are " + std::to_string(n) + " slots");
  for (int s = first; s < first + count; ++s) {
    if (marked_[s])
      throw Error("GradientSync: slot " + std::to_string(s) + " reported ready twice in one backward pass (a layer "
                  "calls grads_ready more than once, or backward ran twice without begin())");
    marked_[s] = true;
    if (o_.rebuild && !rebuild_done_ && comm_.size() > 1) observed_.push_back(s);
  }
  if (!sync_ || (comm_.size() == 1 && !o_.release)) return;
  for (int s = first; s < first + count; ++s) --buckets_[bucket_of_slot_[s]].pending;
  if (comm_.size() == 1) {
    // Released, one replica: nothing travels. A complete bucket goes once the next one is complete
    // too, as if its collective took as long as backward takes to fill the next bucket (the overlap
    // buckets are cut for); memplan measures a run's release this way.
    while (next_launch_ < static_cast<int>(buckets_.size()) && buckets_[next_launch_].pending == 0) ++next_launch_;
    while (next_complete_ + 1 < next_launch_) complete(buckets_[next_complete_++]);
    return;
  }
  // Launch in bucket index order: a complete bucket waits for the ones before it, so every rank
  // issues the same sequence of collectives whatever order its slots became ready in.
  while (next_launch_ < static_cast<int>(buckets_.size()) && buckets_[next_launch_].pending == 0) {
    launch(buckets_[next_launch_++]);
    launched_early_++;
  }
  // Release mode: buckets whose collective is over go now, in order, while backward goes on.
  while (o_.release && next_complete_ < next_launch_ && buckets_[next_complete_].work->done()) {
    buckets_[next_complete_].done_ns = steady_ns();
    complete(buckets_[next_complete_++]);
  }
}

void GradientSync::finish(Stream* order) {
  if (o_.release && sync_ && comm_.size() == 1) {  // nothing travels: the shard is the whole sum
    for (size_t k = static_cast<size_t>(next_complete_); k < buckets_.size(); ++k) complete(buckets_[k]);
    next_complete_ = static_cast<int>(buckets_.size());
    return;
  }
  if (!sync_ || comm_.size() == 1) return;
  // Launch in bucket order any bucket backward did not complete, so every rank issues the same
  // sequence of collectives.
  while (next_launch_ < static_cast<int>(buckets_.size())) launch(buckets_[next_launch_++]);
  for (size_t k = o_.release ? static_cast<size_t>(next_complete_) : 0; k < buckets_.size(); ++k) {
    Bucket& b = buckets_[k];
    if (order) b.work->order_before(*order);
    else b.work->wait();
    b.done_ns = steady_ns();
    if (o_.release) complete(b);  // on the compute stream, after the bucket
    else unpack(b);
  }
  next_complete_ = static_cast<int>(buckets_.size());
  // The first synchronised pass has shown the order: the next begin() re-cuts the buckets (in
  // begin, so this step's buckets stay readable, e.g. for the timeline). A pass in which some
  // slot got no gradient shows no complete order; the next one is watched instead.
  if (o_.rebuild && !rebuild_done_ && observed_.size() == offsets_.size()) rebuild_pending_ = true;
}

void GradientSync::drain() {
  for (auto& b : buckets_) {
    if (!b.work) continue;
    try {
      b.work->wait();
    } catch (const std::exception&) {  // an aborted group: the failure was already reported
    }
    b.work = nullptr;
  }
  zero();
}

void GradientSync::forget_work() {
  for (auto& b : buckets_) b.work = nullptr;
}

void GradientSync::check() const {
  for (const auto& b : buckets_)
    if (b.work) b.work->check();
}

void broadcast_from_root(Communicator& comm, Tensor& t) {
  if (comm.size() > 1) comm.broadcast(t.raw(), static_cast<size_t>(t.numel()), t.dtype(), 0);
}

namespace {
MemoryPool& device_pool(Communicator& comm, MemoryPool* pool) {
  if (!pool) throw CommError(comm.name() + " reduces device memory only and no device pool was given for host data");
  return *pool;
}
}  // namespace

// An in-place collective on host floats: straight on a host communicator, through a temporary
// device copy on one that needs device buffers (NCCL).
template <typename Collective>
void in_place_on_host(Communicator& comm, MemoryPool* pool, float* data, size_t n, Collective run) {
  if (!comm.device_buffers()) return run(static_cast<void*>(data));
  Tensor d = Tensor::empty(device_pool(comm, pool), {static_cast<int64_t>(n)}, DType::f32, MemTag::other);
  tensor_from_bytes(d, data, n * sizeof(float));
  run(d.raw());
  std::string back = tensor_to_bytes(d);
  std::memcpy(data, back.data(), back.size());
}

void all_reduce_host(Communicator& comm, MemoryPool* pool, float* data, size_t n, ReduceOp op) {
  in_place_on_host(comm, pool, data, n, [&](void* p) { comm.all_reduce(p, n, DType::f32, op); });
}

void broadcast_host(Communicator& comm, MemoryPool* pool, float* data, size_t n, int root) {
  in_place_on_host(comm, pool, data, n, [&](void* p) { comm.broadcast(p, n, DType::f32, root); });
}

void all_gather_host(Communicator& comm, MemoryPool* pool, const float* send, float* recv, size_t n) {
  if (!comm.device_buffers()) return comm.all_gather(send, recv, n, DType::f32);
  MemoryPool& dp = device_pool(comm, pool);
  Tensor s = Tensor::empty(dp, {static_cast<int64_t>(n)}, DType::f32, MemTag::other);
  Tensor r = Tensor::empty(dp, {static_cast<int64_t>(n) * comm.size()}, DType::f32, MemTag::other);
  tensor_from_bytes(s, send, n * sizeof(float));
  comm.all_gather(s.raw(), r.raw(), n, DType::f32);
  std::string back = tensor_to_bytes(r);
  std::memcpy(recv, back.data(), back.size());
}

void all_gather_v_host(Communicator& comm, MemoryPool* pool, float* data, size_t n, const std::vector<size_t>& bounds) {
  in_place_on_host(comm, pool, data, n, [&](void* p) { comm.all_gather_v(p, n, DType::f32, bounds); });
}

void check_replicas_agree(Communicator& comm, const Tensor& params, int64_t step) {
  if (comm.size() == 1) return;
  // FNV-1a over the bytes, folded into two exactly representable floats.
  const std::string bytes = tensor_to_bytes(params);
  const uint64_t h = fnv1a(bytes.data(), bytes.size());
  float mine[2] = {static_cast<float>(h & 0xffffff), static_cast<float>((h >> 24) & 0xffffff)};
  std::vector<float> all(2 * comm.size());
  all_gather_host(comm, params.pool(), mine, all.data(), 2);
  std::string bad;
  for (int r = 1; r < comm.size(); ++r)
    if (all[2 * r] != all[0] || all[2 * r + 1] != all[1]) bad += (bad.empty() ? "" : ", ") + std::to_string(r);
  if (!bad.empty())
    throw TrainingError("replicas diverged at step " + std::to_string(step) + ": parameters of rank(s) " + bad +
                        " differ from rank 0's. Something made replicas compute different updates "
                        "(non-deterministic op, uninitialised memory or a missed all-reduce).");
}

}  // namespace replica::parallel
