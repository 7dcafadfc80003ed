// The upstreams at the bottom of a device's memory stack: host pages, the simulation for tests,
// and the limit that every pool's capacity is.
#include <cstdlib>

#include "core/device.h"
#include "core/memory/resource.h"

namespace replica {

const char* mem_tag_name(MemTag t) {
  static const char* names[] = {"params", "grads", "optimizer", "activations", "workspace", "comm", "data", "other"};
  return names[static_cast<int>(t)];
}

void* HostUpstream::allocate(size_t bytes) {
  const size_t rounded = (bytes + 4095) & ~size_t(4095);
  return std::aligned_alloc(4096, rounded);
}
void HostUpstream::deallocate(void* p, size_t) { std::free(p); }
size_t HostUpstream::total_memory() const { return host_physical_memory(); }

void* SimulatedUpstream::allocate(size_t bytes) {
  if (bytes > available_ - outstanding_) return nullptr;
  void* p = reinterpret_cast<void*>(next_);
  next_ += (bytes + 4095) & ~uintptr_t(4095);
  outstanding_ += bytes;
  calls_++;
  return p;
}
void SimulatedUpstream::deallocate(void*, size_t bytes) { outstanding_ -= bytes; }

void* BlockUpstream::allocate(size_t bytes) {
  if (taken_ || bytes > bytes_) return nullptr;
  taken_ = true;
  return block_;
}
void BlockUpstream::deallocate(void* p, size_t) {
  if (p == block_) taken_ = false;
}

void* LimitedUpstream::allocate(size_t bytes) {
  calls_++;
  if (bytes > limit_ - outstanding_) return nullptr;
  void* p = inner_->allocate(bytes);
  if (!p) return nullptr;
  outstanding_ += bytes;
  peak_ = std::max(peak_, outstanding_);
  return p;
}
void LimitedUpstream::deallocate(void* p, size_t bytes) {
  inner_->deallocate(p, bytes);
  outstanding_ -= bytes;
}

}  // namespace replica
