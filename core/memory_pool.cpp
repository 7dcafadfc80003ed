// MemoryPool: composes the memory stack for a device and fronts it.
#include "core/memory_pool.h"

#include <algorithm>
#include <map>
#include <sstream>

#include "core/errors.h"
#include "core/memory/best_fit_pool.h"
#include "core/memory/direct_resource.h"

namespace replica {

MemoryPool::MemoryPool(Device device, std::unique_ptr<Upstream> upstream, PoolOptions options)
    : device_(device), options_(std::move(options)) {
  total_ = upstream->total_memory();
  upstream_name_ = upstream->name();
  capacity_ = pool_capacity(options_, total_, device_.str() + " (" + upstream_name_ + ")");
  limited_ = std::make_unique<LimitedUpstream>(std::move(upstream), capacity_);
  if (options_.mode == AllocatorMode::platform) {
    base_ = std::make_unique<DirectResource>(limited_.get());
  } else {
    std::unique_ptr<RegionPolicy> policy;
    if (options_.mode == AllocatorMode::preallocate) policy = std::make_unique<PreallocatePolicy>();
    else policy = std::make_unique<GrowthPolicy>(options_.growth_initial);
    auto pool = std::make_unique<BestFitPool>(limited_.get(), std::move(policy));
    if (pool->first_region_failed())
      throw OutOfMemoryError(
          "could not preallocate " + format_bytes(capacity_) + " on " + device_.str() + " (" + upstream_name_ +
              ", total " + format_bytes(total_) +
              "): that much is not free, perhaps another process holds it. Lower the fraction "
              "(memory.fraction / REPLICA_MEM_FRACTION) or grow on demand "
              "(memory.mode: growth / REPLICA_PREALLOCATE=false).",
          capacity_);
    base_ = std::move(pool);
  }
  plan_ = std::make_unique<StepPlanResource>(base_.get());
  trace_ = std::make_unique<TraceAdaptor>(plan_.get());
  stats_ = std::make_unique<StatisticsAdaptor>(trace_.get());
  oom_ = std::make_unique<OomAdaptor>(stats_.get(), stats_.get(), device_, options_);
  restack();
}

void MemoryPool::restack() {
  MemoryResource* below = base_.get();
  if (plan_in_stack_) below = plan_.get();
  trace_->set_below(below);
  if (trace_in_stack_) below = trace_.get();
  stats_->set_below(below);
}

MemoryPool::~MemoryPool() {
  // Platform mode owns nothing cached: whatever is still live goes back to the upstream.
  if (options_.mode == AllocatorMode::platform)
    live_.for_each([&](const void*, Live* l) { base_->deallocate(l->a, l->r); });
}

namespace {
thread_local ThreadAllocationCount* t_counting = nullptr;
}  // namespace

ThreadAllocationCount::ThreadAllocationCount(const MemoryPool& pool) : pool_(&pool), previous_(t_counting) {
  t_counting = this;
}
ThreadAllocationCount::~ThreadAllocationCount() { t_counting = previous_; }

void* MemoryPool::allocate(size_t bytes, MemTag tag, Stream* stream) {
  for (ThreadAllocationCount* c = t_counting; c; c = c->previous_)
    if (c->pool_ == this) ++c->count_;
  const size_t rounded = std::max(kGranularity, (bytes + kGranularity - 1) & ~(kGranularity - 1));
  if (stream && stream->synchronous()) stream = nullptr;  // nothing to order on a CPU
  const AllocRequest r{rounded, bytes, tag, stream};
  std::lock_guard<detail::SpinLock> lock(mu_);
  const Allocation a = oom_->allocate(r);  // throws OutOfMemoryError
  Live* l = live_records_.get();
  *l = {a, r, AllocationSite::current()};
  live_.insert(a.ptr, l);
  return a.ptr;
}

void MemoryPool::deallocate(void* p) {
  if (!p) return;
  std::lock_guard<detail::SpinLock> lock(mu_);
  bool found = false;
  Live* l = live_.take(p, found);
  if (!found)
    throw Error("MemoryPool(" + device_.str() + "): deallocate of a pointer this pool did not hand out "
                "(double free, or memory from another pool)");
  oom_->deallocate(l->a, l->r);
  live_records_.put(l);
}

void MemoryPool::record_stream(void* p, Stream* stream) {
  if (!p || !stream || stream->synchronous()) return;
  std::lock_guard<detail::SpinLock> lock(mu_);
  bool found = false;
  Live* l = live_.take(p, found);
  if (!found) return;
  live_.insert(p, l);
  oom_->record_stream(l->a, stream);
}

PoolStats MemoryPool::stats() const {
  std::lock_guard<detail::SpinLock> lock(mu_);
  const UsageStats& u = stats_->usage();
  const MemoryInfo m = base_->info();
  PoolStats s;
  s.in_use = u.in_use;
  s.requested = u.requested;
  s.peak_in_use = u.peak_in_use;
  s.allocs = u.allocs;
  s.frees = u.frees;
  s.tags = u.tags;
  s.reserved = m.reserved;
  s.peak_reserved = m.peak_reserved;
  s.capacity = capacity_;
  s.largest_free = m.largest_free;
  s.total_free = m.free;
  s.fragmentation = s.total_free ? 1.0 - static_cast<double>(s.largest_free) / s.total_free : 0.0;
  s.regions = m.regions;
  s.upstream_calls = limited_->calls();
  s.ooms = oom_->ooms();
  return s;
}

void MemoryPool::reset_peaks() {
  std::lock_guard<detail::SpinLock> lock(mu_);
  oom_->reset_peaks();
}

void MemoryPool::push_scope() {
  std::lock_guard<detail::SpinLock> lock(mu_);
  stats_->push_scope();
}

ScopeStats MemoryPool::pop_scope() {
  std::lock_guard<detail::SpinLock> lock(mu_);
  return stats_->pop_scope();
}

void MemoryPool::set_oom_advice(OomAdvice advice) {
  std::lock_guard<detail::SpinLock> lock(mu_);
  oom_->set_advice(std::move(advice));
}

void MemoryPool::set_trace(AllocTrace* trace) {
  std::lock_guard<detail::SpinLock> lock(mu_);
  trace_->set_trace(trace);
  trace_in_stack_ = trace != nullptr;
  restack();
}

void MemoryPool::set_step(int64_t step) {
  std::lock_guard<detail::SpinLock> lock(mu_);
  trace_->set_step(step);
}

size_t MemoryPool::release_unused() {
  std::lock_guard<detail::SpinLock> lock(mu_);
  return oom_->release_unused();
}

std::vector<std::pair<std::string, size_t>> MemoryPool::live_by_site(MemTag tag) const {
  std::lock_guard<detail::SpinLock> lock(mu_);
  std::map<std::string, size_t> by;
  live_.for_each([&](const void*, Live* l) {
    if (l->r.tag == tag) by[l->site ? l->site : "(unnamed)"] += l->r.size;
  });
  std::vector<std::pair<std::string, size_t>> out(by.begin(), by.end());
  std::sort(out.begin(), out.end(), [](auto& a, auto& b) { return a.second > b.second; });
  return out;
}

void MemoryPool::plan_record_begin() {
  std::lock_guard<detail::SpinLock> lock(mu_);
  if (options_.mode == AllocatorMode::platform)
    throw ConfigError("memory.step_plan needs the preallocate or growth pool, not platform");
  plan_->record_begin();
  plan_in_stack_ = true;
  restack();
}

void MemoryPool::plan_record_end() {
  std::lock_guard<detail::SpinLock> lock(mu_);
  AllocRequest arena;
  if (!plan_->record_end(&arena)) oom_->fail(arena);
}

void MemoryPool::plan_step_begin() {
  std::lock_guard<detail::SpinLock> lock(mu_);
  plan_->step_begin();
}

void MemoryPool::plan_step_end() {
  std::lock_guard<detail::SpinLock> lock(mu_);
  plan_->step_end();
}

void MemoryPool::plan_clear() {
  std::lock_guard<detail::SpinLock> lock(mu_);
  plan_->clear();
  plan_in_stack_ = false;
  restack();
}

StepPlanStats MemoryPool::plan_stats() const {
  std::lock_guard<detail::SpinLock> lock(mu_);
  return plan_->stats();
}

std::string MemoryPool::describe() const {
  std::ostringstream os;
  os << allocator_mode_name(options_.mode) << " ";
  if (options_.mode == AllocatorMode::preallocate) os << format_bytes(capacity_) << " taken at start";
  else os << "up to " << format_bytes(capacity_);
  if (options_.bytes) os << " (memory.bytes)";
  else os << " (" << options_.fraction << " of " << format_bytes(total_) << " " << upstream_name_ << ")";
  return os.str();
}

namespace {
thread_local const char* tl_site = nullptr;
}
AllocationSite::AllocationSite(const char* name) : previous_(tl_site) { tl_site = name; }
AllocationSite::~AllocationSite() { tl_site = previous_; }
const char* AllocationSite::current() { return tl_site; }

}  // namespace replica
