// InputStager: double-buffered host-to-device input copies on the copy stream.
#include "train/input_stager.h"

#include "core/cuda/runtime.h"
#include "core/errors.h"

namespace replica::train {

InputStager::InputStager(MemoryPool& device_pool, Stream* copy, Stream* compute)
    : pool_(device_pool), copy_(copy), compute_(compute) {}

InputStager::~InputStager() {
  try {
    clear();
  } catch (...) {  // a failed device: nothing left to wait for
  }
}

void InputStager::push(data::Batch b) {
  if (full()) throw Error("InputStager::push: two batches are staged already; pop() one first");
  Slot& s = slots_[(head_ + count_) % 2];
  if (!copy_) {  // CPU: the batch is already in host memory the kernels read
    s.host = std::move(b);
    s.images = s.host.images;
    s.labels = s.host.labels;
    count_++;
    return;
  }
  if (s.copied) s.copied->synchronize();  // the previous host batch of this slot may go now
  s.host = std::move(b);
  if (!s.images.defined() || s.images.shape() != s.host.images.shape() ||
      s.labels.shape() != s.host.labels.shape()) {
    // The slots are written by the copy stream and read by the compute stream: allocated for the
    // copy stream, the pool hands over no block that queued compute work may still read (it is
    // stream-ordered), and record_stream makes their eventual free wait for compute's reads too.
    // No host synchronisation.
    s.images = Tensor::empty(pool_, s.host.images.shape(), s.host.images.dtype(), MemTag::data, copy_);
    s.labels = Tensor::empty(pool_, s.host.labels.shape(), s.host.labels.dtype(), MemTag::data, copy_);
    pool_.record_stream(s.images.raw(), compute_);
    pool_.record_stream(s.labels.raw(), compute_);
    s.consumed = nullptr;
  }
  if (s.consumed) copy_->wait(*s.consumed);  // the micro-step that read this slot has run
  if (pool_.device().kind == DeviceKind::cpu) {  // staging ahead on a CPU (tests the GPU path's order)
    copy_tensor(s.host.images, s.images);
    copy_tensor(s.host.labels, s.labels);
  } else {
    cuda::copy_async(s.images.raw(), s.host.images.raw(), s.images.nbytes(), *copy_);
    cuda::copy_async(s.labels.raw(), s.host.labels.raw(), s.labels.nbytes(), *copy_);
  }
  s.copied = copy_->record();
  count_++;
}

std::pair<Tensor, Tensor> InputStager::front() {
  if (empty()) throw Error("InputStager::front: nothing staged");
  Slot& s = slots_[head_];
  if (copy_) compute_->wait(*s.copied);
  return {s.images, s.labels};
}

void InputStager::pop() {
  if (empty()) throw Error("InputStager::pop: nothing staged");
  Slot& s = slots_[head_];
  if (copy_) {
    s.consumed = compute_->record();
  } else {
    s = Slot();
  }
  head_ = (head_ + 1) % 2;
  count_--;
}

void InputStager::clear() {
  if (copy_) copy_->synchronize();
  while (!empty()) pop();
  for (auto& s : slots_) s.host = data::Batch();
}

}  // namespace replica::train
