// BestFitPool: the coalescing best-fit pool over an upstream, stream-ordered (RMM's
// pool_memory_resource over stream_ordered_memory_resource). How it asks its upstream for
// memory is a RegionPolicy: all of it at once (preallocate, like JAX) or growing regions.
#pragma once
#include <array>
#include <memory>
#include <utility>
#include <vector>

#include "core/memory/resource.h"
#include "core/slab.h"

namespace replica {

// When and how much the pool asks its upstream for.
class RegionPolicy {
 public:
  virtual ~RegionPolicy() = default;
  // The region taken when the pool is made (0: none); `available` is what the upstream allows.
  virtual size_t first_region(size_t available) = 0;
  // A region for a request of `need` bytes that no free block fits; 0: do not grow.
  virtual size_t next_region(size_t need, size_t available) = 0;
  // The upstream gave a region of `bytes`.
  virtual void on_region(size_t bytes) { (void)bytes; }
  // Whether whole unused regions may go back to the upstream.
  virtual bool releases() const = 0;
  virtual const char* name() const = 0;
};

// Everything the upstream allows, once, at start-up; never grows, never gives back.
class PreallocatePolicy : public RegionPolicy {
 public:
  size_t first_region(size_t available) override { return available; }
  size_t next_region(size_t, size_t) override { return 0; }
  bool releases() const override { return false; }
  const char* name() const override { return "preallocate"; }
};

// Regions on demand, each at least twice the last (TensorFlow's BFC growth), up to the limit.
class GrowthPolicy : public RegionPolicy {
 public:
  explicit GrowthPolicy(size_t initial) : next_(std::max(initial, kMemoryGranularity)) {}
  size_t first_region(size_t) override { return 0; }
  size_t next_region(size_t need, size_t available) override;
  void on_region(size_t bytes) override { next_ = std::max(next_, bytes) * 2; }
  bool releases() const override { return true; }
  const char* name() const override { return "growth"; }

 private:
  size_t next_;
};

class BestFitPool final : public MemoryResource {
 public:
  // Throws nothing: a first region the upstream refuses leaves the pool empty (failed() says so).
  BestFitPool(Upstream* upstream, std::unique_ptr<RegionPolicy> policy);
  ~BestFitPool() override;
  BestFitPool(const BestFitPool&) = delete;
  BestFitPool& operator=(const BestFitPool&) = delete;

  // Stream-ordered (RMM's rule): a block belongs to the stream it was allocated for, and to every
  // stream handed it with record_stream(). Once freed it is reused at once by those streams (their
  // later work is ordered after the earlier), and by any other stream only once an event on each of
  // them has completed. The event is recorded when another stream first asks for the block, not at
  // every free (most blocks go back to their own stream: PyTorch's caching allocator records none
  // for them either); an event recorded later covers all the work the free had to wait for. Streams
  // are named by StreamToken, never by pointer: a stream that dies leaves its last event behind
  // (blocks freed after it are waited for, on any thread), and a new stream at a dead one's address
  // is another stream. When nothing else fits and the pool cannot grow, a pending block is taken
  // after its events are waited for on the host (never handed over early). A null stream records
  // no events.
  Allocation allocate(const AllocRequest& r) override;
  void deallocate(const Allocation& a, const AllocRequest& r) override;
  void record_stream(const Allocation& a, Stream* stream) override;
  MemoryInfo info() const override;
  size_t release_unused() override;
  void reset_peaks() override { peak_reserved_ = reserved_; }

  bool first_region_failed() const { return first_failed_; }
  size_t first_region_size() const { return first_size_; }
  const RegionPolicy& policy() const { return *policy_; }

 private:
  // Free blocks are kept in size classes, two levels as in TLSF (Masmano et al., 2004): a power
  // of two of 256-byte units, split into 16 equal steps (below 16 units one class per size).
  // Each class is an unsorted doubly linked list, and a bitmap says which classes have blocks,
  // so finding a class is a few bit scans and inserting or removing a block is O(1).
  static constexpr int kSubBits = 4, kSub = 1 << kSubBits;
  static constexpr int kClasses = (64 - kSubBits) * kSub;
  static constexpr int kWords = kClasses / 64;
  struct alignas(64) Block {  // one cache line: a merge touches three of them
    char* ptr = nullptr;
    size_t size = 0;
    bool free = true;
    Block* prev = nullptr;  // neighbours by address inside one region
    Block* next = nullptr;
    Block* free_prev = nullptr;  // neighbours in its class's free list while free
    Block* free_next = nullptr;
    // Stream ordering, only for asynchronous streams (null on CPU: nothing to track).
    // One stream's work that a free block must wait for: `event` once recorded (null until
    // another stream asks; `token` records it then).
    struct Pending {
      std::shared_ptr<StreamToken> token;
      std::shared_ptr<Event> event;
    };
    struct StreamUse {
      std::shared_ptr<StreamToken> owner;               // allocated for
      std::vector<std::shared_ptr<StreamToken>> users;  // record_stream()
      std::vector<Pending> pending;                     // free: at most one entry per stream
    };
    std::unique_ptr<StreamUse> streams;
  };
  static int class_of(size_t size);
  // The first class at or above `c` holding a free block; -1 when none.
  int next_nonempty(int c) const;
  // True when `stream` may take free block b now: every pending entry is its own or done.
  static bool usable_by(Block* b, Stream* stream);
  // Adds `p` to `into`'s entries: one per stream, a not-yet-recorded event covering a recorded one.
  static void add_pending(std::vector<Block::Pending>& into, Block::Pending p);
  static void merge_pending(Block* into, Block* from);

  Block* new_block();
  void recycle(Block* b) { blocks_.put(b); }
  void insert_free(Block* b);
  void erase_free(Block* b);
  // The best free block `stream` may use now; with may_wait, else one whose pending events it
  // waits for on the host.
  Block* find_best_fit(size_t size, Stream* stream, bool may_wait);
  bool add_region(size_t bytes);
  void split(Block* b, size_t size);
  size_t largest_free_block() const;

  Upstream* upstream_;
  std::unique_ptr<RegionPolicy> policy_;
  std::array<Block*, kClasses> heads_{};    // each class's free list
  std::array<uint64_t, kWords> nonempty_{};  // bit c set when class c has a free block
  std::vector<std::pair<char*, size_t>> regions_;
  detail::Slab<Block> blocks_;
  size_t reserved_ = 0, peak_reserved_ = 0, in_use_ = 0;
  bool first_failed_ = false;
  size_t first_size_ = 0;
};

}  // namespace replica
