// MemoryPool: the per-device allocator every replica owns. Three modes (preallocate, growth,
// platform), best-fit with coalescing over size bins, stats by tag, actionable OOM errors and an
// optional event trace. Thread safe.
#pragma once
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/device.h"
#include "core/stream.h"
#include "core/node_arena.h"
#include "core/ptr_map.h"

namespace replica {

enum class AllocatorMode { preallocate, growth, platform };
const char* allocator_mode_name(AllocatorMode m);
AllocatorMode parse_allocator_mode(const std::string& s, const std::string& what);

// What an allocation is for; stats are split by it. `data` is the loader's input batches (their
// number in flight depends on prefetch timing, so they are kept apart from activations).
enum class MemTag : uint8_t { params, grads, optimizer, activations, workspace, comm, data, other };
constexpr int kNumTags = 8;
const char* mem_tag_name(MemTag t);

// Where a pool's memory comes from (rmm's "upstream resource").
class Upstream {
 public:
  virtual ~Upstream() = default;
  // Returns nullptr when the memory is not available (the pool turns that into an OOM error).
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p, size_t bytes) = 0;
  // The device's total memory, the base of `fraction`.
  virtual size_t total_memory() const = 0;
  virtual std::string name() const = 0;
};

// Page-aligned host memory.
class HostUpstream : public Upstream {
 public:
  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) override;
  size_t total_memory() const override;
  std::string name() const override { return "host"; }
};

// Hands out fake, never-dereferenced addresses: tests pool policy at any size without memory.
class SimulatedUpstream : public Upstream {
 public:
  // `available` below `total` plays another process holding the rest of the device.
  explicit SimulatedUpstream(size_t total, size_t available = SIZE_MAX) : total_(total), available_(std::min(total, available)) {}
  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) override;
  size_t total_memory() const override { return total_; }
  std::string name() const override { return "simulated"; }
  size_t outstanding() const { return outstanding_; }
  size_t calls() const { return calls_; }

 private:
  size_t total_, available_;
  uintptr_t next_ = 1ull << 40;
  size_t outstanding_ = 0, calls_ = 0;
};

struct PoolOptions {
  AllocatorMode mode = AllocatorMode::growth;
  double fraction = 0.75;   // of the device's total memory: the preallocated region or the limit
  size_t bytes = 0;         // absolute capacity; overrides fraction when non-zero
  size_t growth_initial = size_t(2) << 20;  // first region in growth mode (doubles after)
  // Where each setting came from, for error messages ("REPLICA_MEM_FRACTION", "memory.fraction").
  std::string mode_source = "default", fraction_source = "default";
};

// Applies REPLICA_PREALLOCATE, REPLICA_MEM_FRACTION, REPLICA_ALLOCATOR (JAX's
// XLA_PYTHON_CLIENT_* counterparts) over `base`. An invalid value throws ConfigError naming the
// variable and what it accepts. `getenv` is injectable for tests.
PoolOptions pool_options_from_env(PoolOptions base,
                                  const char* (*getenv_fn)(const char*) = nullptr);
void validate_fraction(double f, const std::string& what);

struct TagStats {
  size_t in_use = 0, peak_in_use = 0;
  size_t allocs = 0;
};

struct PoolStats {
  size_t in_use = 0;         // bytes handed out (rounded to the granularity)
  size_t requested = 0;      // bytes asked for (unrounded)
  size_t peak_in_use = 0;
  size_t reserved = 0;       // bytes taken from the upstream
  size_t peak_reserved = 0;
  size_t capacity = 0;       // the most this pool may reserve
  size_t largest_free = 0;   // largest block that one allocation could get without growing
  size_t total_free = 0;     // reserved - in_use
  double fragmentation = 0;  // 1 - largest_free / total_free (0 when nothing is free)
  size_t allocs = 0, frees = 0, ooms = 0, regions = 0, upstream_calls = 0;
  std::array<TagStats, kNumTags> tags{};
};

// Peak and count over a phase (push_scope ... pop_scope).
struct ScopeStats {
  size_t start_in_use = 0, peak_in_use = 0, end_in_use = 0, allocs = 0;
  size_t peak_delta() const { return peak_in_use - start_in_use; }
};

class AllocTrace;

// Step-planned allocation: what a training step allocates repeats exactly from step to step.
struct StepPlanStats {
  bool active = false;          // a plan exists
  size_t arena_bytes = 0;       // the block its offsets live in
  size_t recorded_peak = 0;     // peak live bytes of the planned allocations when recorded
  size_t planned = 0, unplanned = 0;  // allocations of the recorded step served by / outside the plan
  int64_t steps_served = 0;     // steps served entirely from the plan
  int64_t steps_diverged = 0;   // steps that left the plan (and fell back to best-fit)
  std::string last_divergence;  // why, the last time
};

// The facts of an out-of-memory, handed to the advice callback a caller installs (train/ adds
// what to change in its configuration; core/ names no training setting).
struct OomReport {
  Device device;
  size_t requested = 0, rounded = 0, capacity = 0, in_use = 0, total_free = 0, largest_free = 0;
  MemTag tag = MemTag::other;
  AllocatorMode mode = AllocatorMode::growth;
  bool nothing_allocated = false;  // the request alone exceeds the pool
  bool fragmented = false;         // enough is free in total, not in one piece
  PoolOptions options;             // how the capacity was set (bytes or fraction, and from where)
};
using OomAdvice = std::function<std::string(const OomReport&)>;

class MemoryPool {
 public:
  static constexpr size_t kGranularity = 256;

  MemoryPool(Device device, std::unique_ptr<Upstream> upstream, PoolOptions options);
  ~MemoryPool();
  MemoryPool(const MemoryPool&) = delete;
  MemoryPool& operator=(const MemoryPool&) = delete;

  // Returns 256-byte aligned memory; throws OutOfMemoryError (pool stays usable).
  //
  // Stream-ordered (RMM's rule): a block belongs to the stream it was allocated for (`stream`,
  // default the thread's current stream). When it is freed, an event is recorded on that stream
  // and on every stream handed it with record_stream(); the block is then reused at once by the
  // same stream (its later work is ordered after the earlier), and by another stream only once
  // those events have completed. When nothing else fits, a pending block is taken after its
  // events are waited for on the host (never handed over early). Synchronous streams (CPU) and
  // null record no events: their blocks are free for anyone at once, as before.
  void* allocate(size_t bytes, MemTag tag, Stream* stream);
  void* allocate(size_t bytes, MemTag tag) { return allocate(bytes, tag, current_stream()); }
  void deallocate(void* p);
  // A live block is also used by `stream` (PyTorch's recordStream): its free waits for that
  // stream's work too.
  void record_stream(void* p, Stream* stream);

  PoolStats stats() const;
  void reset_peaks();
  void push_scope();
  ScopeStats pop_scope();

  // Optional event trace; the pool does not own it. `step` labels events.
  void set_trace(AllocTrace* trace);
  // What an out-of-memory message ends with (what to change); without one, a generic line.
  void set_oom_advice(OomAdvice advice);
  void set_step(int64_t step);

  // Live bytes of `tag` grouped by the site that allocated them (see AllocationSite).
  std::vector<std::pair<std::string, size_t>> live_by_site(MemTag tag) const;

  // Step planning (preallocate and growth modes; only the calling thread's allocations are
  // recorded and served, so a loader thread allocating at the same time is not disturbed):
  //   plan_record_begin(); <one step>; plan_record_end();     // pack the step's allocations
  //   plan_step_begin(); <a step>; plan_step_end();            // serve them in O(1)
  // An allocation that differs from the recording (size, tag, order, or a block the plan
  // reuses not yet freed) ends the plan for that step: it and the rest go to best-fit.
  void plan_record_begin();
  void plan_record_end();
  void plan_step_begin();
  void plan_step_end();
  void plan_clear();
  StepPlanStats plan_stats() const;

  // Frees regions that are entirely unused (growth mode); returns the bytes released.
  size_t release_unused();

  const Device& device() const { return device_; }
  const PoolOptions& options() const { return options_; }
  size_t capacity() const { return capacity_; }
  std::string describe() const;  // "preallocate 1.5 GiB (0.75 of 2 GiB host)"

 private:
  struct Block {
    char* ptr = nullptr;
    size_t size = 0;
    bool free = true;
    Block* prev = nullptr;  // neighbours by address inside one region
    Block* next = nullptr;
    MemTag tag = MemTag::other;
    size_t requested = 0;
    const char* site = nullptr;  // the layer (or phase) that allocated it, for leak reports
    // Stream ordering, only for asynchronous streams (null on CPU: nothing to track).
    struct StreamUse {
      Stream* owner = nullptr;                                           // allocated for
      std::vector<Stream*> users;                                        // record_stream()
      std::vector<std::pair<Stream*, std::shared_ptr<Event>>> pending;   // free: events to pass
    };
    std::unique_ptr<StreamUse> streams;
  };
  // True when `stream` may take free block b now: every pending event is its own or done.
  static bool usable_by(Block* b, Stream* stream);
  static void merge_pending(Block* into, Block* from);
  struct BySize {
    bool operator()(const Block* a, const Block* b) const {
      return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
    }
  };
  static constexpr int kBins = 48;
  static int bin_of(size_t size);

  Block* new_block();
  void recycle(Block* b);
  void insert_free(Block* b);
  void erase_free(Block* b);
  // The best free block `stream` may use now; with may_wait, else one whose pending events it
  // waits for on the host.
  Block* find_best_fit(size_t size, Stream* stream, bool may_wait);
  bool add_region(size_t min_bytes);
  [[noreturn]] void throw_oom(size_t bytes, size_t rounded, MemTag tag);
  void on_alloc(size_t rounded, size_t requested, MemTag tag, void* p);
  void on_free(size_t rounded, size_t requested, MemTag tag, void* p);
  size_t largest_free_locked() const;

  Device device_;
  std::unique_ptr<Upstream> upstream_;
  PoolOptions options_;
  size_t capacity_ = 0;
  size_t next_region_ = 0;

  using FreeSet = std::set<Block*, BySize, detail::NodeAllocator<Block*>>;

  mutable std::mutex mu_;
  std::unique_ptr<detail::NodeArena> arena_ = std::make_unique<detail::NodeArena>();
  std::vector<FreeSet> bins_;
  uint64_t nonempty_ = 0;  // bit b set when bins_[b] has a free block: best-fit skips empty bins
  detail::PtrMap<Block*> live_;
  std::vector<std::pair<char*, size_t>> regions_;
  std::vector<std::unique_ptr<Block[]>> block_slabs_;
  std::vector<Block*> spare_blocks_;
  PoolStats st_;
  std::vector<ScopeStats> scopes_;
  AllocTrace* trace_ = nullptr;
  OomAdvice oom_advice_;
  int64_t step_ = 0;

  // step planning (guarded by mu_)
  struct PlanItem {
    size_t size = 0;
    MemTag tag = MemTag::other;
    bool planned = false;  // freed within the step: lives in the arena
    size_t offset = 0;
    std::vector<int> must_be_free;  // earlier items sharing its bytes
  };
  void* plan_serve(size_t rounded, size_t bytes, MemTag tag);
  std::thread::id plan_thread_;
  bool recording_ = false, serving_ = false, diverged_ = false;
  std::vector<PlanItem> plan_;
  std::vector<std::pair<size_t, size_t>> rec_life_;  // [begin, end) per recorded item
  detail::PtrMap<int> rec_live_, plan_live_;
  size_t rec_clock_ = 0, next_ = 0;
  std::vector<char> freed_;
  char* plan_arena_ = nullptr;
  size_t plan_arena_size_ = 0;
  StepPlanStats plan_st_;
};

std::string format_bytes(size_t bytes);

// Names what the calling thread is allocating for while it lives (layers set their name during
// forward and backward); allocations record it, leak reports print it. The name must outlive
// the allocations (layer names do).
class AllocationSite {
 public:
  explicit AllocationSite(const char* name);
  ~AllocationSite();
  static const char* current();

 private:
  const char* previous_;
};

}  // namespace replica
