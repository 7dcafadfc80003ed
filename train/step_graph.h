// StepGraph: train.cuda_graph on one GPU replica. A micro-step's device work (forward, loss,
// backward) is a few hundred kernel launches whose host cost bounds small batches and small
// models; here it runs eagerly for the first steps (cuDNN settles its algorithms, the backend its
// scratch, and the pass's memory peak is measured), is then captured once as a CUDA graph, and
// replayed: one launch a micro-step.
//
// A graph replays the addresses it was captured with, so everything it touches stays put:
//  - the pass allocates from a private pool carved out of the replica's pool (tag other), which
//    nothing else ever gets bytes of; every allocation of the captured pass is freed within it;
//  - each micro-batch is copied into fixed input buffers (the stager alternates two slots);
//  - the loss weight (the fp16 loss scale moves it) is baked into the loss gradient: one graph per
//    weight (the last few kept), and a graph is captured again when the backend's scratch moved
//    (Backend::capture_epoch).
// verify (train.cuda_graph: auto): the first replay is compared with an eager pass from the same
// state (gradients, batch-norm statistics, the loss sums): bit for bit in deterministic mode, else
// within 1e-3 of each buffer's largest magnitude. A difference, like any failure to capture, turns
// graphs off for the rest of the run, saying why, and the step goes on eagerly.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/cuda/runtime.h"
#include "core/memory_pool.h"
#include "ops/nn/model.h"
#include "parallel/replica_group.h"

namespace replica::train {

class StepGraph {
 public:
  // The pass: forward, loss and backward of one micro-batch, allocating from `pool`.
  using Pass = std::function<void(MemoryPool& pool, const Tensor& images, const Tensor& labels)>;
  // stats: the step's device scalars the pass adds its loss sums to.
  StepGraph(parallel::Replica& replica, nn::Model& model, Tensor stats, bool verify, bool deterministic);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // Runs one micro-step's pass: eagerly (the warm-up, a batch of another shape, or graphs off) or
  // by replaying its graph.
  void run(const Tensor& images, const Tensor& labels, float weight, const Pass& pass);
  bool off() const { return !off_.empty(); }
  const std::string& off_reason() const { return off_; }
  int64_t replays() const { return replays_; }
  // One line for the run's end: replays, captures, the graph's size and the private pool.
  std::string summary() const;

  static constexpr int kWarmupPasses = 2;

 private:
  struct Entry {
    float weight = 0;
    uint64_t epoch = 0;
    std::unique_ptr<cuda::CapturedGraph> graph;
  };
  bool prepare(const Tensor& images, const Tensor& labels);
  Entry& capture(float weight, const Pass& pass);
  void check(Entry& e, const Tensor& images, const Tensor& labels, const Pass& pass);
  void turn_off(const std::string& why);

  parallel::Replica& rep_;
  nn::Model& model_;
  Tensor stats_;
  bool verify_, deterministic_, checked_ = false;
  int eager_ = 0;
  size_t peak_ = 0;  // the eager passes' pool use above their start, at most
  void* block_ = nullptr;
  size_t block_bytes_ = 0;
  std::unique_ptr<MemoryPool> pool_;
  Tensor images_, labels_;
  std::vector<Entry> cache_;
  std::string off_;
  int64_t captures_ = 0, replays_ = 0;
  size_t nodes_ = 0;
};

}  // namespace replica::train
