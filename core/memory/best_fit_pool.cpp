// BestFitPool. Free blocks live in two-level size classes (see the header), each an unsorted
// list. A request takes the smallest block that fits from its own class (whose blocks may be a
// little smaller or larger than it), else the first usable block of the next class that has
// one: every block there fits, and is at most 1/16 larger than that class's smallest size.
// So a free block that fits is always found (no false out-of-memory), and a search is a list
// scan of one class plus a few bitmap words. Freed blocks merge with free neighbours at once,
// so a pool whose allocations are all freed is one block per region again.
#include "core/memory/best_fit_pool.h"

#include <algorithm>

namespace replica {

size_t GrowthPolicy::next_region(size_t need, size_t available) {
  size_t bytes = std::min(std::max(next_, need), available) & ~(kMemoryGranularity - 1);
  return bytes < need ? 0 : bytes;
}

BestFitPool::BestFitPool(Upstream* upstream, std::unique_ptr<RegionPolicy> policy)
    : upstream_(upstream), policy_(std::move(policy)) {
  first_size_ = policy_->first_region(upstream_->available()) & ~(kMemoryGranularity - 1);
  if (first_size_ && !add_region(first_size_)) first_failed_ = true;
}

BestFitPool::~BestFitPool() {
  for (auto& [p, n] : regions_) upstream_->deallocate(p, n);
}

int BestFitPool::class_of(size_t size) {
  const size_t units = size / kMemoryGranularity;
  if (units < kSub) return static_cast<int>(units);
  const int level = 63 - __builtin_clzll(units);
  const int step = static_cast<int>(units >> (level - kSubBits)) & (kSub - 1);
  return (level - kSubBits + 1) * kSub + step;
}

int BestFitPool::next_nonempty(int c) const {
  if (c >= kClasses) return -1;
  int w = c >> 6;
  uint64_t bits = nonempty_[w] & (~uint64_t(0) << (c & 63));
  while (!bits) {
    if (++w == kWords) return -1;
    bits = nonempty_[w];
  }
  return w * 64 + __builtin_ctzll(bits);
}

BestFitPool::Block* BestFitPool::new_block() {
  Block* b = blocks_.get();
  *b = Block{};
  return b;
}

void BestFitPool::insert_free(Block* b) {
  const int c = class_of(b->size);
  b->free_prev = nullptr;
  b->free_next = heads_[c];
  if (heads_[c]) heads_[c]->free_prev = b;
  heads_[c] = b;
  nonempty_[c >> 6] |= uint64_t(1) << (c & 63);
}

void BestFitPool::erase_free(Block* b) {
  const int c = class_of(b->size);
  if (b->free_prev) b->free_prev->free_next = b->free_next;
  else heads_[c] = b->free_next;
  if (b->free_next) b->free_next->free_prev = b->free_prev;
  if (!heads_[c]) nonempty_[c >> 6] &= ~(uint64_t(1) << (c & 63));
}

bool BestFitPool::usable_by(Block* b, Stream* stream) {
  if (!b->streams || b->streams->pending.empty()) return true;
  auto& pending = b->streams->pending;
  const uint64_t own = stream ? stream->id() : 0;  // ids start at 1: the null stream owns nothing
  bool all_done = true;
  for (auto& p : pending) {
    if (p.token->id() == own) {  // its own work: later work on that stream is ordered after it
      all_done = all_done && p.event && p.event->done();
      continue;
    }
    if (!p.event) p.event = p.token->record();  // another stream asks: mark that stream's work now
    if (p.event && !p.event->done()) return false;
  }
  if (all_done) pending.clear();
  return true;
}

void BestFitPool::add_pending(std::vector<Block::Pending>& into, Block::Pending p) {
  for (auto& q : into) {
    if (q.token->id() != p.token->id()) continue;
    // Two entries of one stream: an event still to be recorded covers any recorded earlier; of two
    // recorded ones either may be the later, so both stay (waiting for both is right).
    if (!q.event) return;
    if (!p.event) {
      q.event = nullptr;
      return;
    }
    if (q.event == p.event) return;
  }
  into.push_back(std::move(p));
}

void BestFitPool::merge_pending(Block* into, Block* from) {
  if (!from->streams || from->streams->pending.empty()) return;
  if (!into->streams) into->streams = std::make_unique<Block::StreamUse>();
  for (auto& p : from->streams->pending) add_pending(into->streams->pending, std::move(p));
}

BestFitPool::Block* BestFitPool::find_best_fit(size_t size, Stream* stream, bool may_wait) {
  const int c = class_of(size);
  Block* pending_fit = nullptr;  // the best fit still in use by another stream's queued work
  Block* best = nullptr;
  for (Block* b = heads_[c]; b; b = b->free_next) {  // its own class: the smallest that fits
    if (b->size < size || (best && b->size >= best->size)) continue;
    if (!usable_by(b, stream)) {
      if (!pending_fit || b->size < pending_fit->size) pending_fit = b;
      continue;
    }
    best = b;
    if (b->size == size) break;
  }
  if (best) return best;
  for (int k = next_nonempty(c + 1); k >= 0; k = next_nonempty(k + 1)) {
    for (Block* b = heads_[k]; b; b = b->free_next) {  // larger classes: any block fits
      if (usable_by(b, stream)) return b;
      if (!pending_fit) pending_fit = b;
    }
  }
  if (!pending_fit || !may_wait) return nullptr;
  // Nothing else fits (and the pool cannot grow): take it once the host has seen its events
  // complete (RMM does the same when it takes a block from another stream's free list).
  for (auto& p : pending_fit->streams->pending) {
    if (!p.event) p.event = p.token->record();
    if (p.event) p.event->synchronize();
  }
  pending_fit->streams->pending.clear();
  return pending_fit;
}

bool BestFitPool::add_region(size_t bytes) {
  void* p = upstream_->allocate(bytes);
  if (!p) return false;
  policy_->on_region(bytes);
  regions_.emplace_back(static_cast<char*>(p), bytes);
  Block* b = new_block();
  b->ptr = static_cast<char*>(p);
  b->size = bytes;
  insert_free(b);
  reserved_ += bytes;
  peak_reserved_ = std::max(peak_reserved_, reserved_);
  return true;
}

void BestFitPool::split(Block* b, size_t size) {
  Block* rest = new_block();
  rest->ptr = b->ptr + size;
  rest->size = b->size - size;
  rest->prev = b;
  rest->next = b->next;
  if (b->next) b->next->prev = rest;
  b->next = rest;
  b->size = size;
  // The tail keeps the events its bytes still wait for; b's were passed (usable_by) or synced.
  if (b->streams && !b->streams->pending.empty()) {
    rest->streams = std::make_unique<Block::StreamUse>();
    rest->streams->pending = b->streams->pending;
  }
  insert_free(rest);
}

Allocation BestFitPool::allocate(const AllocRequest& r) {
  // A block this stream may take now; else a new region (when the policy grows); else a block
  // another stream's work still uses, after waiting for it; else nothing.
  Block* b = find_best_fit(r.size, r.stream, false);
  if (!b) {
    const size_t grow = policy_->next_region(r.size, upstream_->available());
    if (grow && add_region(grow)) b = find_best_fit(r.size, r.stream, false);
  }
  if (!b) b = find_best_fit(r.size, r.stream, true);
  if (!b) return {};
  erase_free(b);
  if (b->size - r.size >= kMemoryGranularity) split(b, r.size);  // the tail stays free
  b->free = false;
  if (r.stream) {
    if (!b->streams) b->streams = std::make_unique<Block::StreamUse>();
    b->streams->owner = r.stream->token();
    b->streams->users.clear();
    b->streams->pending.clear();
  } else if (b->streams) {
    b->streams.reset();
  }
  in_use_ += b->size;
  return {b->ptr, b};
}

void BestFitPool::deallocate(const Allocation& a, const AllocRequest&) {
  Block* b = static_cast<Block*>(a.handle);
  in_use_ -= b->size;
  b->free = true;
  if (b->streams) {  // the work queued on its streams may still read it: to pass before others reuse it
    auto& u = *b->streams;
    if (u.owner) add_pending(u.pending, {std::move(u.owner), nullptr});
    for (auto& t : u.users) add_pending(u.pending, {std::move(t), nullptr});
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

void BestFitPool::record_stream(const Allocation& a, Stream* stream) {
  if (!stream) return;  // the null stream orders nothing
  Block* b = static_cast<Block*>(a.handle);
  if (!b->streams) b->streams = std::make_unique<Block::StreamUse>();
  auto& u = *b->streams;
  const uint64_t id = stream->id();
  const auto same = [&](const std::shared_ptr<StreamToken>& t) { return t->id() == id; };
  if (!(u.owner && same(u.owner)) && std::none_of(u.users.begin(), u.users.end(), same))
    u.users.push_back(stream->token());
}

size_t BestFitPool::largest_free_block() const {
  for (int w = kWords - 1; w >= 0; --w) {
    if (!nonempty_[w]) continue;
    size_t largest = 0;  // the top class's blocks differ by up to 1/16: look at each
    for (Block* b = heads_[w * 64 + 63 - __builtin_clzll(nonempty_[w])]; b; b = b->free_next)
      largest = std::max(largest, b->size);
    return largest;
  }
  return 0;
}

MemoryInfo BestFitPool::info() const {
  MemoryInfo m;
  m.reserved = reserved_;
  m.peak_reserved = peak_reserved_;
  m.capacity = std::min(upstream_->available(), SIZE_MAX - reserved_) + reserved_;
  m.free = reserved_ - in_use_;
  m.headroom = m.capacity - in_use_;
  m.largest_free = largest_free_block();
  m.regions = regions_.size();
  return m;
}

size_t BestFitPool::release_unused() {
  if (!policy_->releases()) return 0;
  size_t released = 0;
  for (size_t i = 0; i < regions_.size();) {
    auto [ptr, n] = regions_[i];
    Block* whole = nullptr;
    for (Block* b = heads_[class_of(n)]; b && !whole; b = b->free_next)
      if (b->ptr == ptr && b->size == n) whole = b;
    if (whole) {
      erase_free(whole);
      recycle(whole);
      upstream_->deallocate(ptr, n);
      reserved_ -= n;
      released += n;
      regions_.erase(regions_.begin() + i);
    } else {
      ++i;
    }
  }
  return released;
}

}  // namespace replica
