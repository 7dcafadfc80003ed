// GradientSync, the DDP reducer: the flat gradient buffer is cut into buckets in reverse
// parameter order (first bucket 1 MiB, then 25 MiB, PyTorch DDP's defaults). Backward reports
// finished parameter slots; a bucket whose slots are all final starts its all-reduce (average) at
// once on the communicator's worker, overlapping the rest of backward. finish() waits for all.
// Micro-steps of gradient accumulation run with sync off (no_sync): nothing is reduced.
#pragma once
#include <functional>
#include <vector>

#include "core/errors.h"
#include "core/memory_pool.h"
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
  // Converts between the f32 gradients and the wire dtype. Host conversion when empty; a GPU
  // replica passes its op backend's cast (parallel/ stands on core and does not know the kernels).
  std::function<void(const Tensor& src, const Tensor& dst)> cast;
};

struct Bucket {
  int64_t lo = 0, hi = 0;       // element range of the flat buffer
  int slots = 0;                // parameter slots in it
  int pending = 0;              // slots not yet final in this step
  WorkHandle work;
  // steady-clock ns of the last step's launch and of finish() seeing it done (for timelines)
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
  // Waits until every bucket is reduced; launches any bucket not yet launched (e.g. parameters
  // that got no gradient this pass). A no-op after a begin(false).
  void finish();

  const std::vector<Bucket>& buckets() const { return buckets_; }
  int launched_during_backward() const { return launched_early_; }

 private:
  void launch(Bucket& b);

  Tensor grads_, staging_;
  std::function<void(const Tensor&, const Tensor&)> cast_;
  Communicator& comm_;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_slot_;
  bool sync_ = true;
  int launched_early_ = 0;
  int next_launch_ = 0;       // buckets launch in index order
  std::vector<bool> marked_;  // slots reported ready in this pass
};

// Broadcasts a float buffer from rank 0 (parameters at start and after resume).
void broadcast_from_root(Communicator& comm, Tensor& t);

// Collectives over host floats on any communicator. A communicator that needs device buffers
// (NCCL) gets a temporary copy in `pool`, the replica's device pool (tag other).
void all_reduce_host(Communicator& comm, MemoryPool* pool, float* data, size_t n, ReduceOp op);
void all_gather_host(Communicator& comm, MemoryPool* pool, const float* send, float* recv, size_t n);
// All replicas must hold bit-identical parameters; throws TrainingError naming the diverging
// ranks and the step otherwise.
void check_replicas_agree(Communicator& comm, const Tensor& params, int64_t step);

}  // namespace replica::parallel
