// Evaluation and the model file see every replica's batch-norm statistics averaged over the
// replicas, and the training state never changes by it (trainer_eval.cpp, trainer.cpp's save).
#pragma once
#include <string>

#include "core/tensor.h"
#include "ops/nn/model.h"
#include "parallel/replica_group.h"

namespace replica::train {

// Runs fn() with this replica's batch-norm running statistics replaced by their average over the
// replicas (each saw its own shard; evaluation and the model file use the average, the same on
// every replica), then puts the replica's own statistics back: evaluating or saving never
// changes the training state, so a resumed run and a straight one stay byte-identical.
template <class F>
auto with_averaged_statistics(parallel::Replica& rep, nn::Model& model, F&& fn) {
  Tensor& b = model.buffers();
  if (rep.world() == 1) return fn();
  const std::string own = tensor_to_bytes(b);
  rep.pmean(b.data<float>(), static_cast<size_t>(b.numel()));
  struct Restore {
    const Tensor& b;
    const std::string& own;
    ~Restore() { tensor_from_bytes(b, own.data(), own.size()); }
  } restore{b, own};
  return fn();
}

}  // namespace replica::train
