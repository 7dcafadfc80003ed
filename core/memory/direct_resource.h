// DirectResource: "no pool" (platform mode, for debugging): every allocation goes straight to
// the upstream and every free straight back, so memory tools see each one and nothing is cached.
#pragma once
#include "core/memory/resource.h"

namespace replica {

class DirectResource final : public MemoryResource {
 public:
  explicit DirectResource(Upstream* upstream) : upstream_(upstream) {}
  Allocation allocate(const AllocRequest& r) override {
    void* p = upstream_->allocate(r.size);
    if (!p) return {};
    reserved_ += r.size;
    peak_reserved_ = std::max(peak_reserved_, reserved_);
    return {p, nullptr};
  }
  // The upstream's free is ordered by the device itself (cudaFree waits for the device), so no
  // stream bookkeeping is needed here.
  void deallocate(const Allocation& a, const AllocRequest& r) override {
    upstream_->deallocate(a.ptr, r.size);
    reserved_ -= r.size;
  }
  void record_stream(const Allocation&, Stream*) override {}
  MemoryInfo info() const override {
    MemoryInfo m;
    m.reserved = reserved_;
    m.peak_reserved = peak_reserved_;
    const size_t more = upstream_->available();
    m.capacity = more == SIZE_MAX ? SIZE_MAX : reserved_ + more;
    m.free = more;           // nothing is cached: free is what the upstream would still give
    m.largest_free = more;
    m.headroom = more;
    return m;
  }
  size_t release_unused() override { return 0; }
  void reset_peaks() override { peak_reserved_ = reserved_; }

 private:
  Upstream* upstream_;
  size_t reserved_ = 0, peak_reserved_ = 0;
};

}  // namespace replica
