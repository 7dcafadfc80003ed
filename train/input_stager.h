// InputStager: moves a replica's input batches to its device ahead of use. On a GPU replica each
// host batch (pinned memory from the loader) is copied on the replica's copy stream into one of
// two device slots while the compute stream is still busy with the previous micro-batch; the
// compute stream waits on the copy's event, and a slot is refilled only after the compute stream
// has passed the micro-step that read it. On a CPU replica batches pass straight through.
#pragma once
#include <deque>
#include <memory>
#include <utility>

#include "core/stream.h"
#include "core/tensor.h"
#include "data/loader.h"

namespace replica::train {

class InputStager {
 public:
  // copy == nullptr: pass-through (CPU replicas). A CPU pool with a copy stream stages ahead by
  // plain copies: the GPU path's order, testable without a GPU (REPLICA_STAGE_AHEAD=1).
  InputStager(MemoryPool& device_pool, Stream* copy, Stream* compute);
  ~InputStager();
  InputStager(const InputStager&) = delete;
  InputStager& operator=(const InputStager&) = delete;

  bool empty() const { return count_ == 0; }
  bool full() const { return count_ == 2; }
  // True when batches are copied ahead (a GPU, or a CPU in the test mode).
  bool ahead() const { return copy_ != nullptr; }
  // Starts moving `b` to the device (returns at once on a GPU). At most two batches are staged.
  void push(data::Batch b);
  // The oldest staged batch as device tensors (images, labels); later compute-stream work waits
  // for its copy.
  std::pair<Tensor, Tensor> front();
  // Done with the front batch once the compute stream passes this point.
  void pop();
  // Drops whatever is staged (waits for copies in flight).
  void clear();

 private:
  struct Slot {
    data::Batch host;           // kept alive until its copy has finished
    Tensor images, labels;      // device memory, reused batch after batch
    std::shared_ptr<Event> copied, consumed;
  };
  MemoryPool& pool_;
  Stream* copy_;
  Stream* compute_;
  Slot slots_[2];
  int head_ = 0, count_ = 0;
};

}  // namespace replica::train
