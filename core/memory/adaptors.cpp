// Statistics, trace and out-of-memory adaptors.
#include "core/memory/adaptors.h"

#include <algorithm>
#include <sstream>

#include "core/alloc_trace.h"
#include "core/errors.h"
#include "core/units.h"

namespace replica {

Allocation StatisticsAdaptor::allocate(const AllocRequest& r) {
  const Allocation a = below_->allocate(r);
  if (!a.ptr) return a;
  st_.in_use += r.size;
  st_.requested += r.requested;
  st_.peak_in_use = std::max(st_.peak_in_use, st_.in_use);
  st_.allocs++;
  auto& t = st_.tags[static_cast<int>(r.tag)];
  t.in_use += r.size;
  t.peak_in_use = std::max(t.peak_in_use, t.in_use);
  t.allocs++;
  for (auto& s : scopes_) {
    s.peak_in_use = std::max(s.peak_in_use, st_.in_use);
    s.allocs++;
  }
  return a;
}

void StatisticsAdaptor::deallocate(const Allocation& a, const AllocRequest& r) {
  below_->deallocate(a, r);
  st_.in_use -= r.size;
  st_.requested -= r.requested;
  st_.frees++;
  st_.tags[static_cast<int>(r.tag)].in_use -= r.size;
}

void StatisticsAdaptor::reset_peaks() {
  st_.peak_in_use = st_.in_use;
  for (auto& t : st_.tags) t.peak_in_use = t.in_use;
  below_->reset_peaks();
}

void StatisticsAdaptor::push_scope() { scopes_.push_back({st_.in_use, st_.in_use, st_.in_use, 0}); }

ScopeStats StatisticsAdaptor::pop_scope() {
  if (scopes_.empty()) throw Error("MemoryPool::pop_scope without push_scope");
  ScopeStats s = scopes_.back();
  scopes_.pop_back();
  s.end_in_use = st_.in_use;
  return s;
}

Allocation TraceAdaptor::allocate(const AllocRequest& r) {
  const Allocation a = below_->allocate(r);
  if (a.ptr && trace_) trace_->record(true, a.ptr, r.requested, r.tag, step_);
  return a;
}

void TraceAdaptor::deallocate(const Allocation& a, const AllocRequest& r) {
  below_->deallocate(a, r);
  if (trace_) trace_->record(false, a.ptr, r.requested, r.tag, step_);
}

void OomAdaptor::fail(const AllocRequest& r) {
  ooms_++;
  const MemoryInfo m = below_->info();
  const UsageStats& u = usage_->usage();
  // "free" is everything that could still be handed out (the headroom); one piece of it is the
  // largest free block (or, without a pool, all of it).
  const size_t free = m.headroom, largest = m.largest_free;
  const double frag = free ? 1.0 - static_cast<double>(largest) / free : 0.0;
  std::array<int, kNumTags> order;
  for (int i = 0; i < kNumTags; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int a, int b) { return u.tags[a].in_use > u.tags[b].in_use; });
  std::ostringstream os;
  os << "out of memory on " << device_.str() << ": could not allocate " << format_bytes(r.requested) << " ("
     << r.size << " B rounded) for " << mem_tag_name(r.tag) << ". Pool: " << allocator_mode_name(options_.mode)
     << ", capacity " << format_bytes(m.capacity) << ", in use " << format_bytes(u.in_use) << ", free "
     << format_bytes(free) << ", largest free block " << format_bytes(largest) << ", fragmentation "
     << static_cast<int>(frag * 100 + 0.5) << "%. ";
  if (u.in_use == 0) {
    os << "Nothing is allocated yet: this one request is larger than the whole pool. ";
  } else {
    os << "Biggest tags:";
    for (int i = 0; i < 3; ++i)
      if (u.tags[order[i]].in_use)
        os << " " << mem_tag_name(static_cast<MemTag>(order[i])) << " " << format_bytes(u.tags[order[i]].in_use);
    os << ". ";
  }
  if (free >= r.size) os << "Enough memory is free in total but not in one piece (fragmentation). ";
  const OomReport rep{device_, r.requested, r.size, m.capacity, u.in_use, free, largest, r.tag, options_.mode,
                      u.in_use == 0, free >= r.size, options_};
  if (advice_) os << advice_(rep);
  else os << "To fit: free memory held elsewhere, allocate less, or give the pool a larger capacity.";
  throw OutOfMemoryError(os.str(), r.requested);
}

}  // namespace replica
