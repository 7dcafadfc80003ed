// GradientSync, the DDP reducer: the flat gradient buffer is cut into buckets in reverse
// parameter order (first bucket 1 MiB, then 25 MiB, PyTorch DDP's defaults). Backward reports
// finished parameter slots; a bucket whose slots are all final starts its all-reduce (average) at
// once on the communicator's worker, overlapping the rest of backward. finish() waits for all.
// Micro-steps of gradient accumulation run with sync off (no_sync): nothing is reduced.
// After the first synchronised pass the buckets are rebuilt from the order the slots actually
// became ready (PyTorch's rebuild_buckets; rank 0's order is broadcast so every rank cuts the
// same buckets): a residual block's shortcut is registered after its main path but its gradient
// is ready later, and a bucket that waits for it holds back every bucket after it.
#pragma once
#include <functional>
#include <vector>

#include "core/errors.h"
#include "core/memory_pool.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "parallel/communicator.h"

namespace replica::parallel {

struct BucketOptions {
  double bucket_mb = 25.0;
  double first_bucket_mb = 1.0;
  // Dtype on the wire: f32, or f16/bf16 to halve the bytes (gradients are rounded into a
  // staging buffer from `staging_pool`, tag comm, averaged by the communicator in 16-bit
  // arithmetic as NCCL does (communicator.h, all_reduce), and converted back to f32).
  DType wire = DType::f32;
  MemoryPool* staging_pool = nullptr;
  // Re-cut the buckets from the observed readiness order after the first synchronised pass.
  bool rebuild = true;
  // Converts between the f32 gradients and the wire dtype. Host conversion when empty; a GPU
  // replica passes its op backend's cast (parallel/ stands on core and does not know the kernels).
  std::function<void(const Tensor& src, const Tensor& dst)> cast;
  // ZeRO-2 (parallel.shard: gradients): world + 1 offsets of the flat buffer, rank r owning
  // [shard[r], shard[r + 1]). A bucket is then reduce-scattered (Communicator::reduce_scatter_v):
  // each rank receives only its part of the reduced bucket, with the bits an all-reduce gives it;
  // the rest of its gradient buffer keeps its local sums. Empty: buckets are all-reduced.
  std::vector<int64_t> shard;
  // ZeRO-2's release (with `shard`): there is no whole gradient buffer. Each bucket's gradients
  // live in storage of its own (tag grads), taken and zeroed when backward first reaches one of
  // its slots (prepare(); `bind` points the slots' gradient tensors there, packed in flat order)
  // and given back once this rank's part of the reduced bucket is in its shard: the `grads`
  // GradientSync was built with is then that shard alone, [shard[rank], shard[rank + 1]).
  // Accumulation keeps a bucket's storage across the micro-steps, so the local sums add exactly
  // as unsharded; a bucket goes as soon as its collective is seen done (polled as backward reports
  // slots), else in finish().
  bool release = false;
  std::function<void(int slot, const Tensor& grad)> bind;  // the slot's elements (flat), or undefined
  int rank = -1;  // whose shard: the communicator's rank when negative (memplan measures the largest)
};

struct Bucket {
  int64_t lo = 0, hi = 0;       // element range of the flat buffer (the hull when it has several)
  int slots = 0;                // parameter slots in it
  // Its element ranges of the flat buffer, merged and increasing: one, unless a rebuild put slots
  // together that are not neighbours in memory (they are then packed into `packed` to travel).
  std::vector<std::pair<int64_t, int64_t>> ranges;
  int64_t elements = 0;
  Tensor packed;
  int pending = 0;              // slots not yet final in this step
  WorkHandle work;
  std::vector<int> members;     // its slots, increasing
  // Release mode: the bucket's gradients (f32, its ranges packed in order) and, on a 16-bit wire,
  // the rounded copy that travels; both only while the step needs them.
  Tensor storage, wire;
  // steady-clock ns of the last step's launch and of finish() seeing it done (for timelines; a
  // finish ordered on a stream records when it returned, not when the device was done)
  int64_t launched_ns = 0, done_ns = 0;
};

class GradientSync {
 public:
  // slot_offsets[i]: where parameter slot i starts in the flat buffer (increasing). parallel/
  // knows flat buffers only, never layers.
  GradientSync(const std::vector<int64_t>& slot_offsets, Tensor grads, Communicator& comm,
               BucketOptions o = {});

  // Backward calls this when slots [first, first + count) hold their final gradients. A slot
  // reported twice in one pass, or a slot that does not exist, is an Error. Complete buckets
  // launch in bucket index order (a later one waits for the earlier ones to complete).
  void ready(int first, int count);
  // Starts a backward pass; with sync false (accumulation micro-step) nothing is reduced.
  void begin(bool sync);
  // Backward calls this before it writes slots [first, first + count): in release mode their
  // buckets' storage is taken (zeroed) and bound; a no-op otherwise.
  void prepare(int first, int count);
  // Release mode: gives back every bucket's storage (a new step; an aborted one's leftovers).
  void zero();
  // Release mode: the gradient elements held now, in buckets' storage (not the shard).
  int64_t held_elements() const;
  // Waits until every bucket is reduced; launches any bucket not yet launched (e.g. parameters
  // that got no gradient this pass). A no-op after a begin(false).
  // With `order` (the replica's compute stream), the wait is on the device where the
  // communicator can (NCCL: a stream wait per bucket, no host wait; the unpacking queues behind
  // it), and the host returns at once; the caller's next host synchronisation should poll
  // check(). Elsewhere, and without `order`, the host waits.
  void finish(Stream* order = nullptr);
  // Throws if a collective of the last finish() has failed or timed out (see Work::check).
  void check() const;
  // Waits for every launched bucket's collective to end, ignoring failures (after an abort,
  // before the gradient buffer is freed).
  void drain();

  // Drops the handles of the last pass's collectives without waiting: a captured step's handles
  // name its capture, not a replay (the replay's are polled through Communicator::stream_work).
  void forget_work();
  // True once the bucket layout is final: no re-cut pending or waiting for an observed order. A
  // re-cut broadcasts rank 0's order on the host, which a captured step cannot hold.
  bool settled() const { return !rebuild_pending_ && (rebuild_done_ || !o_.rebuild || comm_.size() == 1); }
  // Ends the watch for a readiness order (a pass in which some slot got no gradient shows none,
  // and the watch goes on): the buckets stay as they are cut. Every rank must call it at the same
  // pass, as every rank sees the same slots.
  void keep_layout() {
    rebuild_pending_ = false;
    rebuild_done_ = true;
    observed_.clear();
  }

  const std::vector<Bucket>& buckets() const { return buckets_; }
  int launched_during_backward() const { return launched_early_; }
  // 1 when the observed order re-cut the buckets, 0 while it has not or cut the same ones.
  int rebuilds() const { return rebuilds_; }

 private:
  void launch(Bucket& b);
  void unpack(Bucket& b);
  // Release mode: takes a bucket's storage; copies its reduced part into the shard and gives the
  // storage back; where a flat offset falls in the bucket's packed storage.
  void take(Bucket& b);
  void complete(Bucket& b);
  void give_back(Bucket& b);
  int64_t packed_position(const Bucket& b, int64_t flat) const;
  bool releasing() const { return o_.release; }
  int shard_rank() const { return o_.rank >= 0 ? o_.rank : comm_.rank(); }
  // Cuts buckets over `order` (slots, first to reduce first): first_bucket_mb, then bucket_mb.
  void cut(const std::vector<int>& order);
  void rebuild();

  std::vector<int64_t> offsets_;
  int64_t total_ = 0;  // elements of the flat buffer (release mode: more than grads_ holds)
  BucketOptions o_;
  Tensor grads_, staging_;
  std::function<void(const Tensor&, const Tensor&)> cast_;
  Communicator& comm_;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_slot_;
  bool sync_ = true;
  int launched_early_ = 0;
  int next_launch_ = 0;       // buckets launch in index order
  int next_complete_ = 0;     // release mode: and complete in it
  std::vector<bool> marked_;  // slots reported ready in this pass
  std::vector<int> observed_;  // slots in the order they became ready, until the rebuild
  bool rebuild_pending_ = false, rebuild_done_ = false;
  int rebuilds_ = 0;
};

// Where the initial buckets (reverse parameter order, BucketOptions' sizes) start and end in the
// flat buffer, sorted: the cut points a ShardPlan prefers, so that most buckets have one owner.
std::vector<int64_t> initial_bucket_edges(const std::vector<int64_t>& slot_offsets, int64_t total,
                                          const BucketOptions& o);

// Broadcasts a float buffer from rank 0 (parameters at start and after resume).
void broadcast_from_root(Communicator& comm, Tensor& t);

// Collectives over host floats on any communicator. A communicator that needs device buffers
// (NCCL) gets a temporary copy in `pool`, the replica's device pool (tag other).
void all_reduce_host(Communicator& comm, MemoryPool* pool, float* data, size_t n, ReduceOp op);
void all_gather_host(Communicator& comm, MemoryPool* pool, const float* send, float* recv, size_t n);
// Communicator::all_gather_v over host floats (sharded optimizer state gathered for a checkpoint).
void all_gather_v_host(Communicator& comm, MemoryPool* pool, float* data, size_t n, const std::vector<size_t>& bounds);
void broadcast_host(Communicator& comm, MemoryPool* pool, float* data, size_t n, int root);
// All replicas must hold bit-identical parameters; throws TrainingError naming the diverging
// ranks and the step otherwise.
void check_replicas_agree(Communicator& comm, const Tensor& params, int64_t step);

}  // namespace replica::parallel
