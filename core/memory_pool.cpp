// MemoryPool implementation. Free blocks live in size bins (powers of two of 256 B), each an
// ordered set by (size, address), so best-fit is a lower_bound in one bin plus a scan of at most
// kBins bin heads: O(log n). Freed blocks merge with free neighbours at once, so a pool whose
// allocations are all freed is one block per region again.
#include "core/memory_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>

#include "core/alloc_trace.h"
#include "core/env.h"
#include "core/errors.h"
#include "core/lifetime_packing.h"

namespace replica {

const char* allocator_mode_name(AllocatorMode m) {
  switch (m) {
    case AllocatorMode::preallocate: return "preallocate";
    case AllocatorMode::growth: return "growth";
    case AllocatorMode::platform: return "platform";
  }
  return "?";
}

AllocatorMode parse_allocator_mode(const std::string& s, const std::string& what) {
  if (s == "preallocate") return AllocatorMode::preallocate;
  if (s == "growth") return AllocatorMode::growth;
  if (s == "platform") return AllocatorMode::platform;
  throw ConfigError(what + ": '" + s + "' is not an allocator mode; use preallocate, growth or platform");
}

const char* mem_tag_name(MemTag t) {
  static const char* names[] = {"params", "grads", "optimizer", "activations", "workspace", "comm", "data", "other"};
  return names[static_cast<int>(t)];
}

std::string format_bytes(size_t b) {
  char buf[64];
  double v = static_cast<double>(b);
  if (b >= (size_t(1) << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", v / (1 << 30));
  else if (b >= (size_t(1) << 20)) std::snprintf(buf, sizeof buf, "%.2f MiB", v / (1 << 20));
  else if (b >= 1024) std::snprintf(buf, sizeof buf, "%.1f KiB", v / 1024);
  else std::snprintf(buf, sizeof buf, "%zu B", b);
  return buf;
}

// ---- upstreams ----------------------------------------------------------------------------

void* HostUpstream::allocate(size_t bytes) {
  size_t rounded = (bytes + 4095) & ~size_t(4095);
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

// ---- settings from the environment --------------------------------------------------------

void validate_fraction(double f, const std::string& what) {
  if (!(f > 0.0 && f <= 1.0))
    throw ConfigError(what + ": " + std::to_string(f) +
                      " is not a memory fraction; use a number in (0, 1], e.g. 0.75");
}

PoolOptions pool_options_from_env(PoolOptions o, const char* (*getenv_fn)(const char*)) {
  auto get = [&](const char* name) -> const char* {
    return getenv_fn ? getenv_fn(name) : std::getenv(name);
  };
  if (const char* v = get("REPLICA_PREALLOCATE")) {
    const auto b = parse_bool_text(v);
    if (!b)
      throw ConfigError("REPLICA_PREALLOCATE='" + std::string(v) +
                        "' is not a boolean; use true or false (false = grow on demand)");
    o.mode = *b ? AllocatorMode::preallocate : AllocatorMode::growth;
    o.mode_source = "REPLICA_PREALLOCATE";
  }
  if (const char* v = get("REPLICA_ALLOCATOR")) {
    std::string s = v;
    if (s == "platform") {
      o.mode = AllocatorMode::platform;
    } else if (s == "bfc" || s == "default" || s == "pool") {
      if (o.mode == AllocatorMode::platform) o.mode = AllocatorMode::growth;
    } else {
      throw ConfigError("REPLICA_ALLOCATOR='" + s +
                        "' is not an allocator; use default (the pool) or platform "
                        "(every allocation straight from the device, for debugging)");
    }
    o.mode_source = "REPLICA_ALLOCATOR";
  }
  if (const char* v = get("REPLICA_MEM_FRACTION")) {
    char* end = nullptr;
    double f = std::strtod(v, &end);
    if (end == v || *end != '\0')
      throw ConfigError("REPLICA_MEM_FRACTION='" + std::string(v) +
                        "' is not a number; use a fraction in (0, 1], e.g. 0.75");
    if (!(f > 0.0 && f <= 1.0))
      throw ConfigError("REPLICA_MEM_FRACTION='" + std::string(v) +
                        "' is not a memory fraction; use a number in (0, 1], e.g. 0.75");
    o.fraction = f;
    o.fraction_source = "REPLICA_MEM_FRACTION";
  }
  return o;
}

// ---- the pool ------------------------------------------------------------------------------

MemoryPool::MemoryPool(Device device, std::unique_ptr<Upstream> upstream, PoolOptions options)
    : device_(device), upstream_(std::move(upstream)), options_(options) {
  for (int b = 0; b < kBins; ++b) bins_.emplace_back(BySize(), detail::NodeAllocator<Block*>(arena_.get()));
  if (options_.bytes == 0) validate_fraction(options_.fraction, "memory.fraction (" + options_.fraction_source + ")");
  size_t total = upstream_->total_memory();
  if (options_.bytes > total)
    throw ConfigError("memory.bytes: " + format_bytes(options_.bytes) + " is more than " + device_.str() + " has (" +
                      format_bytes(total) + " " + upstream_->name() + "); use a smaller size or memory.fraction");
  capacity_ = options_.bytes ? options_.bytes
                             : static_cast<size_t>(static_cast<double>(total) * options_.fraction);
  capacity_ &= ~(kGranularity - 1);
  st_.capacity = capacity_;
  next_region_ = std::max<size_t>(options_.growth_initial, kGranularity);
  if (options_.mode == AllocatorMode::preallocate) {
    if (!add_region(capacity_)) {
      throw OutOfMemoryError(
          "could not preallocate " + format_bytes(capacity_) + " on " + device_.str() + " (" +
              upstream_->name() + ", total " + format_bytes(total) +
              "): that much is not free, perhaps another process holds it. Lower the fraction "
              "(memory.fraction / REPLICA_MEM_FRACTION) or grow on demand "
              "(memory.mode: growth / REPLICA_PREALLOCATE=false).",
          capacity_);
    }
  }
}

MemoryPool::~MemoryPool() {
  if (options_.mode == AllocatorMode::platform) {
    live_.for_each([&](const void* p, Block* b) { upstream_->deallocate(const_cast<void*>(p), b->size); });
  }
  for (auto& [p, n] : regions_) upstream_->deallocate(p, n);
}

int MemoryPool::bin_of(size_t size) {
  size_t units = size / kGranularity;
  int b = 63 - __builtin_clzll(units | 1);
  return std::min(b, kBins - 1);
}

MemoryPool::Block* MemoryPool::new_block() {
  if (spare_blocks_.empty()) {
    constexpr size_t kSlab = 256;
    block_slabs_.emplace_back(new Block[kSlab]);
    for (size_t i = 0; i < kSlab; ++i) spare_blocks_.push_back(&block_slabs_.back()[i]);
  }
  Block* b = spare_blocks_.back();
  spare_blocks_.pop_back();
  *b = Block{};
  return b;
}
void MemoryPool::recycle(Block* b) { spare_blocks_.push_back(b); }
void MemoryPool::insert_free(Block* b) {
  const int bin = bin_of(b->size);
  bins_[bin].insert(b);
  nonempty_ |= uint64_t(1) << bin;
}
void MemoryPool::erase_free(Block* b) {
  const int bin = bin_of(b->size);
  bins_[bin].erase(b);
  if (bins_[bin].empty()) nonempty_ &= ~(uint64_t(1) << bin);
}

bool MemoryPool::usable_by(Block* b, Stream* stream) {
  if (!b->streams || b->streams->pending.empty()) return true;
  auto& pending = b->streams->pending;
  bool all_done = true;
  for (auto& [s, ev] : pending) {
    if (s == stream) continue;  // its own work: later work on that stream is ordered after it
    if (!ev->done()) return false;
  }
  for (auto& [s, ev] : pending) all_done = all_done && ev->done();
  if (all_done) pending.clear();
  return true;
}

void MemoryPool::merge_pending(Block* into, Block* from) {
  if (!from->streams || from->streams->pending.empty()) return;
  if (!into->streams) into->streams = std::make_unique<Block::StreamUse>();
  auto& dst = into->streams->pending;
  for (auto& p : from->streams->pending) dst.push_back(std::move(p));
}

MemoryPool::Block* MemoryPool::find_best_fit(size_t size, Stream* stream, bool may_wait) {
  Block key;
  key.size = size;
  key.ptr = nullptr;
  const uint64_t fits = nonempty_ & ~((uint64_t(1) << bin_of(size)) - 1);
  Block* pending_fit = nullptr;  // the best fit still in use by another stream's queued work
  for (uint64_t candidates = fits; candidates; candidates &= candidates - 1) {
    const int bin = __builtin_ctzll(candidates);
    for (auto it = bins_[bin].lower_bound(&key); it != bins_[bin].end(); ++it) {
      if (usable_by(*it, stream)) return *it;  // the first fit in a higher bin is that bin's smallest
      if (!pending_fit) pending_fit = *it;
    }
  }
  if (!pending_fit || !may_wait) return nullptr;
  // Nothing else fits (and the pool cannot grow): take it once the host has seen its events
  // complete (RMM does the same when it takes a block from another stream's free list).
  for (auto& [s, ev] : pending_fit->streams->pending) ev->synchronize();
  pending_fit->streams->pending.clear();
  return pending_fit;
}

bool MemoryPool::add_region(size_t min_bytes) {
  if (st_.reserved + min_bytes > capacity_) return false;
  size_t bytes = min_bytes;
  if (options_.mode == AllocatorMode::growth) {
    bytes = std::max(next_region_, min_bytes);
    bytes = std::min(bytes, capacity_ - st_.reserved);
    bytes &= ~(kGranularity - 1);
    if (bytes < min_bytes) return false;
  }
  void* p = upstream_->allocate(bytes);
  st_.upstream_calls++;
  if (!p) return false;
  regions_.emplace_back(static_cast<char*>(p), bytes);
  Block* b = new_block();
  b->ptr = static_cast<char*>(p);
  b->size = bytes;
  insert_free(b);
  st_.reserved += bytes;
  st_.regions++;
  st_.peak_reserved = std::max(st_.peak_reserved, st_.reserved);
  if (options_.mode == AllocatorMode::growth) next_region_ = std::max(next_region_, bytes) * 2;
  return true;
}

void MemoryPool::on_alloc(size_t rounded, size_t requested, MemTag tag, void* p) {
  st_.in_use += rounded;
  st_.requested += requested;
  st_.peak_in_use = std::max(st_.peak_in_use, st_.in_use);
  st_.allocs++;
  auto& t = st_.tags[static_cast<int>(tag)];
  t.in_use += rounded;
  t.peak_in_use = std::max(t.peak_in_use, t.in_use);
  t.allocs++;
  for (auto& s : scopes_) {
    s.peak_in_use = std::max(s.peak_in_use, st_.in_use);
    s.allocs++;
  }
  if (trace_) trace_->record(true, p, requested, tag, step_);
}

void MemoryPool::on_free(size_t rounded, size_t requested, MemTag tag, void* p) {
  st_.in_use -= rounded;
  st_.requested -= requested;
  st_.frees++;
  st_.tags[static_cast<int>(tag)].in_use -= rounded;
  if (trace_) trace_->record(false, p, requested, tag, step_);
}

void* MemoryPool::allocate(size_t bytes, MemTag tag, Stream* stream) {
  size_t rounded = std::max(kGranularity, (bytes + kGranularity - 1) & ~(kGranularity - 1));
  std::lock_guard<std::mutex> lock(mu_);
  if (options_.mode == AllocatorMode::platform) {
    void* p = st_.reserved + rounded <= capacity_ ? upstream_->allocate(rounded) : nullptr;
    st_.upstream_calls++;
    if (!p) throw_oom(bytes, rounded, tag);
    Block* b = new_block();
    b->ptr = static_cast<char*>(p);
    b->size = rounded;
    b->free = false;
    b->tag = tag;
    b->requested = bytes;
    b->site = AllocationSite::current();
    live_.insert(p, b);
    st_.reserved += rounded;
    st_.peak_reserved = std::max(st_.peak_reserved, st_.reserved);
    on_alloc(rounded, bytes, tag, p);
    return p;
  }
  if (serving_ && !diverged_ && std::this_thread::get_id() == plan_thread_)
    if (void* p = plan_serve(rounded, bytes, tag)) return p;
  if (stream && stream->synchronous()) stream = nullptr;  // nothing to order on a CPU
  // A block this stream may take now; else a new region (growth); else a block another stream's
  // work still uses, after waiting for it; else out of memory.
  Block* b = find_best_fit(rounded, stream, false);
  if (!b && options_.mode == AllocatorMode::growth && add_region(rounded)) b = find_best_fit(rounded, stream, false);
  if (!b) b = find_best_fit(rounded, stream, true);
  if (!b) throw_oom(bytes, rounded, tag);
  erase_free(b);
  if (b->size - rounded >= kGranularity) {  // split: the tail stays free
    Block* rest = new_block();
    rest->ptr = b->ptr + rounded;
    rest->size = b->size - rounded;
    rest->prev = b;
    rest->next = b->next;
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->size = rounded;
    // The tail keeps the events its bytes still wait for; b's were passed (usable_by) or synced.
    if (b->streams && !b->streams->pending.empty()) {
      rest->streams = std::make_unique<Block::StreamUse>();
      rest->streams->pending = b->streams->pending;
    }
    insert_free(rest);
  }
  b->free = false;
  if (stream) {
    if (!b->streams) b->streams = std::make_unique<Block::StreamUse>();
    b->streams->owner = stream;
    b->streams->users.clear();
    b->streams->pending.clear();
  } else if (b->streams) {
    b->streams.reset();
  }
  b->tag = tag;
  b->requested = bytes;
  b->site = AllocationSite::current();
  live_.insert(b->ptr, b);
  on_alloc(b->size, bytes, tag, b->ptr);
  if (recording_ && std::this_thread::get_id() == plan_thread_) {
    rec_live_.insert(b->ptr, static_cast<int>(plan_.size()));
    plan_.push_back({b->size, tag, false, 0, {}});
    rec_life_.push_back({rec_clock_++, SIZE_MAX});
  }
  return b->ptr;
}

void MemoryPool::deallocate(void* p) {
  if (!p) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (plan_arena_ && static_cast<char*>(p) >= plan_arena_ && static_cast<char*>(p) < plan_arena_ + plan_arena_size_) {
    bool found = false;
    int k = plan_live_.take(p, found);
    if (!found) throw Error("MemoryPool(" + device_.str() + "): double free inside the step plan");
    freed_[k] = 1;
    on_free(plan_[k].size, plan_[k].size, plan_[k].tag, p);
    return;
  }
  if (recording_) {
    bool rec = false;
    int k = rec_live_.take(p, rec);
    if (rec) rec_life_[k].second = rec_clock_++;
  }
  bool found = false;
  Block* b = live_.take(p, found);
  if (!found)
    throw Error("MemoryPool(" + device_.str() + "): deallocate of a pointer this pool did not hand out "
                "(double free, or memory from another pool)");
  on_free(b->size, b->requested, b->tag, p);
  if (options_.mode == AllocatorMode::platform) {
    upstream_->deallocate(p, b->size);
    st_.reserved -= b->size;
    recycle(b);
    return;
  }
  b->free = true;
  if (b->streams) {  // the work queued on its streams may still read it: events to pass first
    auto& u = *b->streams;
    if (u.owner) u.pending.emplace_back(u.owner, u.owner->record());
    for (Stream* s : u.users) u.pending.emplace_back(s, s->record());
    u.owner = nullptr;
    u.users.clear();
  }
  if (b->next && b->next->free) {  // merge the right neighbour into b
    Block* n = b->next;
    erase_free(n);
    merge_pending(b, n);
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    recycle(n);
  }
  if (b->prev && b->prev->free) {  // merge b into the left neighbour
    Block* l = b->prev;
    erase_free(l);
    merge_pending(l, b);
    l->size += b->size;
    l->next = b->next;
    if (b->next) b->next->prev = l;
    recycle(b);
    b = l;
  }
  insert_free(b);
}

size_t MemoryPool::largest_free_locked() const {
  if (options_.mode == AllocatorMode::platform) {
    return capacity_ - st_.reserved;
  }
  if (!nonempty_) return 0;
  return (*bins_[63 - __builtin_clzll(nonempty_)].rbegin())->size;
}

PoolStats MemoryPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  PoolStats s = st_;
  s.largest_free = largest_free_locked();
  s.total_free = options_.mode == AllocatorMode::platform ? capacity_ - s.reserved : s.reserved - s.in_use;
  s.fragmentation = s.total_free ? 1.0 - static_cast<double>(s.largest_free) / s.total_free : 0.0;
  return s;
}

void MemoryPool::reset_peaks() {
  std::lock_guard<std::mutex> lock(mu_);
  st_.peak_in_use = st_.in_use;
  st_.peak_reserved = st_.reserved;
  for (auto& t : st_.tags) t.peak_in_use = t.in_use;
}

void MemoryPool::push_scope() {
  std::lock_guard<std::mutex> lock(mu_);
  scopes_.push_back({st_.in_use, st_.in_use, st_.in_use, 0});
}

ScopeStats MemoryPool::pop_scope() {
  std::lock_guard<std::mutex> lock(mu_);
  if (scopes_.empty()) throw Error("MemoryPool::pop_scope without push_scope");
  ScopeStats s = scopes_.back();
  scopes_.pop_back();
  s.end_in_use = st_.in_use;
  return s;
}

void MemoryPool::record_stream(void* p, Stream* stream) {
  if (!p || !stream || stream->synchronous()) return;
  std::lock_guard<std::mutex> lock(mu_);
  bool found = false;
  Block* b = live_.take(p, found);
  if (!found) return;  // not a best-fit block (platform mode, the step plan): nothing to order
  live_.insert(p, b);
  if (!b->streams) b->streams = std::make_unique<Block::StreamUse>();
  if (b->streams->owner != stream &&
      std::find(b->streams->users.begin(), b->streams->users.end(), stream) == b->streams->users.end())
    b->streams->users.push_back(stream);
}

void MemoryPool::set_oom_advice(OomAdvice advice) {
  std::lock_guard<std::mutex> lock(mu_);
  oom_advice_ = std::move(advice);
}

void MemoryPool::set_trace(AllocTrace* trace) {
  std::lock_guard<std::mutex> lock(mu_);
  trace_ = trace;
}
void MemoryPool::set_step(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  step_ = step;
}

size_t MemoryPool::release_unused() {
  std::lock_guard<std::mutex> lock(mu_);
  if (options_.mode != AllocatorMode::growth) return 0;
  size_t released = 0;
  for (size_t i = 0; i < regions_.size();) {
    auto [ptr, n] = regions_[i];
    Block* whole = nullptr;
    for (auto* b : bins_[bin_of(n)])
      if (b->ptr == ptr && b->size == n) whole = b;
    if (whole) {
      erase_free(whole);
      recycle(whole);
      upstream_->deallocate(ptr, n);
      st_.reserved -= n;
      st_.regions--;
      released += n;
      regions_.erase(regions_.begin() + i);
    } else {
      ++i;
    }
  }
  return released;
}

namespace {
thread_local const char* tl_site = nullptr;
}
AllocationSite::AllocationSite(const char* name) : previous_(tl_site) { tl_site = name; }
AllocationSite::~AllocationSite() { tl_site = previous_; }
const char* AllocationSite::current() { return tl_site; }

std::vector<std::pair<std::string, size_t>> MemoryPool::live_by_site(MemTag tag) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, size_t> by;
  live_.for_each([&](const void*, Block* b) {
    if (b->tag == tag) by[b->site ? b->site : "(unnamed)"] += b->size;
  });
  std::vector<std::pair<std::string, size_t>> out(by.begin(), by.end());
  std::sort(out.begin(), out.end(), [](auto& a, auto& b) { return a.second > b.second; });
  return out;
}

void MemoryPool::plan_record_begin() {
  std::lock_guard<std::mutex> lock(mu_);
  if (options_.mode == AllocatorMode::platform)
    throw ConfigError("memory.step_plan needs the preallocate or growth pool, not platform");
  if (plan_arena_) throw Error("MemoryPool: plan_clear() before recording a new plan");
  plan_.clear();
  rec_life_.clear();
  rec_clock_ = 0;
  plan_thread_ = std::this_thread::get_id();
  recording_ = true;
}

void MemoryPool::plan_record_end() {
  std::vector<LifetimeItem> items;
  std::vector<int> which;
  {
    std::lock_guard<std::mutex> lock(mu_);
    recording_ = false;
    rec_live_ = detail::PtrMap<int>();
    for (size_t k = 0; k < plan_.size(); ++k)
      if (rec_life_[k].second != SIZE_MAX) {  // freed within the step: plannable
        plan_[k].planned = true;
        items.push_back({plan_[k].size, rec_life_[k].first, rec_life_[k].second});
        which.push_back(static_cast<int>(k));
      }
  }
  const size_t arena = pack_lifetimes(items);
  // peak live of the planned allocations, for the stats
  std::vector<std::pair<size_t, long long>> delta;
  for (auto& it : items) {
    delta.push_back({it.begin, static_cast<long long>(it.size)});
    delta.push_back({it.end, -static_cast<long long>(it.size)});
  }
  std::sort(delta.begin(), delta.end());
  long long live = 0, peak = 0;
  for (auto& d : delta) peak = std::max(peak, live += d.second);
  // The arena is one block of the pool, reserved but not counted as in use: the planned
  // allocations inside it are.
  char* base = arena ? static_cast<char*>(allocate(arena, MemTag::other)) : nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  if (base) {
    bool found = false;
    Block* b = live_.take(base, found);
    live_.insert(base, b);
    st_.in_use -= b->size;
    st_.requested -= arena;
    st_.tags[static_cast<int>(MemTag::other)].in_use -= b->size;
  }
  plan_arena_ = base;
  plan_arena_size_ = arena;
  for (size_t i = 0; i < items.size(); ++i) plan_[which[i]].offset = items[i].offset;
  // For each planned allocation, the earlier ones it reuses bytes of must be freed first.
  for (size_t i = 0; i < items.size(); ++i)
    for (size_t j = 0; j < items.size(); ++j)
      if (items[j].end <= items[i].begin && items[j].offset < items[i].offset + items[i].size &&
          items[i].offset < items[j].offset + items[j].size)
        plan_[which[i]].must_be_free.push_back(which[j]);
  plan_st_ = {};
  plan_st_.active = plan_arena_ != nullptr;
  plan_st_.arena_bytes = arena;
  plan_st_.recorded_peak = static_cast<size_t>(peak);
  plan_st_.planned = items.size();
  plan_st_.unplanned = plan_.size() - items.size();
}

void MemoryPool::plan_step_begin() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!plan_arena_) return;
  plan_thread_ = std::this_thread::get_id();
  serving_ = true;
  diverged_ = plan_live_.size() != 0;  // a planned block outlived its step: do not reuse the arena
  if (diverged_) plan_st_.last_divergence = "a planned block from the previous step is still alive";
  next_ = 0;
  freed_.assign(plan_.size(), 0);
}

void* MemoryPool::plan_serve(size_t rounded, size_t bytes, MemTag tag) {
  const size_t k = next_++;
  auto diverge = [&](const std::string& why) -> void* {
    diverged_ = true;
    plan_st_.last_divergence = "allocation #" + std::to_string(k) + ": " + why;
    return nullptr;
  };
  if (k >= plan_.size()) return diverge("more allocations than the recorded step");
  const PlanItem& it = plan_[k];
  if (it.size != rounded || it.tag != tag)
    return diverge(std::to_string(rounded) + " B of " + mem_tag_name(tag) + " where the plan has " +
                   std::to_string(it.size) + " B of " + mem_tag_name(it.tag));
  if (!it.planned) return nullptr;  // outlives the step: best-fit serves it, the plan goes on
  for (int j : it.must_be_free)
    if (!freed_[j]) return diverge("reuses the bytes of allocation #" + std::to_string(j) + ", not yet freed");
  char* p = plan_arena_ + it.offset;
  plan_live_.insert(p, static_cast<int>(k));
  on_alloc(rounded, bytes, tag, p);
  return p;
}

void MemoryPool::plan_step_end() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!serving_) return;
  serving_ = false;
  if (!diverged_ && next_ != plan_.size()) {
    diverged_ = true;
    plan_st_.last_divergence = "the step made " + std::to_string(next_) + " allocations, the plan " +
                               std::to_string(plan_.size());
  }
  if (diverged_) plan_st_.steps_diverged++;
  else plan_st_.steps_served++;
}

void MemoryPool::plan_clear() {
  void* base = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (plan_live_.size()) throw Error("MemoryPool::plan_clear while planned blocks are alive");
    base = plan_arena_;
    if (base) {  // give the accounting back before the block is freed
      bool found = false;
      Block* b = live_.take(base, found);
      live_.insert(base, b);
      st_.in_use += b->size;
      st_.requested += plan_arena_size_;
      st_.tags[static_cast<int>(MemTag::other)].in_use += b->size;
    }
    plan_arena_ = nullptr;
    plan_arena_size_ = 0;
    serving_ = recording_ = false;
    plan_.clear();
    plan_st_ = {};
  }
  if (base) deallocate(base);
}

StepPlanStats MemoryPool::plan_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return plan_st_;
}

std::string MemoryPool::describe() const {
  std::ostringstream os;
  os << allocator_mode_name(options_.mode) << " ";
  if (options_.mode == AllocatorMode::preallocate) os << format_bytes(capacity_) << " taken at start";
  else os << "up to " << format_bytes(capacity_);
  if (options_.bytes) os << " (memory.bytes)";
  else os << " (" << options_.fraction << " of " << format_bytes(upstream_->total_memory()) << " " << upstream_->name() << ")";
  return os.str();
}

void MemoryPool::throw_oom(size_t bytes, size_t rounded, MemTag tag) {
  st_.ooms++;
  size_t largest = largest_free_locked();
  size_t total_free = options_.mode == AllocatorMode::platform ? capacity_ - st_.reserved
                      : options_.mode == AllocatorMode::growth ? capacity_ - st_.in_use
                                                              : st_.reserved - st_.in_use;
  double frag = total_free ? 1.0 - static_cast<double>(largest) / total_free : 0.0;
  std::array<int, kNumTags> order;
  for (int i = 0; i < kNumTags; ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return st_.tags[a].in_use > st_.tags[b].in_use; });
  std::ostringstream os;
  os << "out of memory on " << device_.str() << ": could not allocate " << format_bytes(bytes)
     << " (" << rounded << " B rounded) for " << mem_tag_name(tag) << ". Pool: "
     << allocator_mode_name(options_.mode) << ", capacity " << format_bytes(capacity_) << ", in use "
     << format_bytes(st_.in_use) << ", free " << format_bytes(total_free) << ", largest free block "
     << format_bytes(largest) << ", fragmentation " << static_cast<int>(frag * 100 + 0.5) << "%. ";
  if (st_.in_use == 0) {
    os << "Nothing is allocated yet: this one request is larger than the whole pool. ";
  } else {
    os << "Biggest tags:";
    for (int i = 0; i < 3; ++i)
      if (st_.tags[order[i]].in_use)
        os << " " << mem_tag_name(static_cast<MemTag>(order[i])) << " " << format_bytes(st_.tags[order[i]].in_use);
    os << ". ";
  }
  if (total_free >= rounded)
    os << "Enough memory is free in total but not in one piece (fragmentation). ";
  OomReport r{device_, bytes, rounded, capacity_, st_.in_use, total_free, largest, tag, options_.mode,
              st_.in_use == 0, total_free >= rounded, options_};
  if (oom_advice_) os << oom_advice_(r);
  else os << "To fit: free memory held elsewhere, allocate less, or give the pool a larger capacity.";
  throw OutOfMemoryError(os.str(), bytes);
}

}  // namespace replica
