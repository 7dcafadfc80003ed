// Sharded, augmented, prefetching loader. Which samples a replica sees is a pure function of
// (seed, epoch, step, rank, micro-step): step s of an epoch takes the global batch
// perm[s*B, (s+1)*B) of a seeded permutation; replica r takes its contiguous 1/R of it, and
// micro-step k the k-th micro-batch of that. Augmentation draws from (seed, epoch, index) alone,
// so runs are reproducible whatever the thread timing or replica count.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "core/memory_pool.h"
#include "core/tensor.h"
#include "data/augment_policies.h"
#include "data/dataset.h"
#include "data/mixing.h"

namespace replica::data {

struct AugmentOptions {
  int64_t pad_crop = 0;      // pad by this many pixels and crop back at a random offset
  bool hflip = false;        // random horizontal flip
  std::vector<float> mean;   // per channel, applied after scaling to [0,1]; empty = none
  std::vector<float> std;
  MixOptions mix;            // mixup / cutmix in pairs after normalising (data/mixing.h)
  PolicyOptions policy;      // AutoAugment / RandAugment / TrivialAugment before, random erasing after normalising
};

class Sharding {
 public:
  // global_batch = micro_batch * accumulation * world; the last partial batch is dropped.
  Sharding(int64_t dataset_size, int64_t micro_batch, int accumulation, int world, uint64_t seed,
           bool shuffle);
  int64_t steps_per_epoch() const { return steps_; }
  int64_t global_batch() const { return micro_ * accum_ * world_; }
  int64_t micro_batch() const { return micro_; }
  int accumulation() const { return accum_; }
  // Dataset indices of (epoch, step, rank, micro).
  std::vector<int64_t> indices(int64_t epoch, int64_t step, int rank, int micro) const;
  const std::vector<int64_t>& permutation(int64_t epoch) const;

 private:
  int64_t n_, micro_;
  int accum_, world_;
  uint64_t seed_;
  bool shuffle_;
  int64_t steps_;
  mutable std::mutex m_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> perm_;
};

struct Batch {
  Tensor images;  // [n,H,W,C] f32, normalised
  Tensor labels;  // [n] i32, or [n, 2] when mixing: (label, weight of its own label; data/mixing.h)
  int64_t epoch = 0, step = 0;
  int micro = 0;
  int64_t n() const { return images.defined() ? images.dim(0) : 0; }
};

// Fills `out` (n x sample) and `labels` for the given indices, augmenting when asked.
void load_samples(const Dataset& ds, const std::vector<int64_t>& idx, const AugmentOptions& aug,
                  bool augment, uint64_t seed, int64_t epoch, float* out, int32_t* labels);

// One replica's training loader: a background thread prepares the micro-batches of an epoch in
// order into a bounded queue; tensors come from the replica's pool (tag activations).
class ReplicaLoader {
 public:
  // workers > 1 splits each micro-batch across that many threads (GPU replicas, whose host
  // cores are otherwise idle; a CPU replica keeps 1 so the loader does not take compute cores).
  ReplicaLoader(const Dataset& ds, const Sharding& sharding, int rank, MemoryPool& pool,
                AugmentOptions aug, uint64_t seed, int prefetch = 2, int workers = 1);
  ~ReplicaLoader();
  // Starts producing epoch `epoch` from step `first_step` (a resumed run starts mid-epoch).
  void begin_epoch(int64_t epoch, int64_t first_step = 0);
  // The next micro-batch in (step, micro) order; blocks while it is being prepared.
  Batch next();
  // Seconds the caller spent blocked in next() (data wait).
  double wait_seconds() const { return wait_s_; }

 private:
  void stop();
  void produce(int64_t epoch, int64_t first_step);

  const Dataset& ds_;
  const Sharding& sh_;
  int rank_;
  MemoryPool& pool_;
  AugmentOptions aug_;
  uint64_t seed_;
  size_t depth_;
  int workers_;
  std::thread thread_;
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<Batch> queue_;
  std::exception_ptr error_;
  bool stop_ = false;
  double wait_s_ = 0;
};

}  // namespace replica::data
