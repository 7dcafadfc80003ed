// MemoryPool: the per-device allocator every replica owns, the front of a stack of small memory
// resources (core/memory/resource.h draws it). The front rounds requests, serialises calls,
// keeps the table of live allocations (what each is for, which layer allocated it: leak reports,
// double-free detection) and composes the stack from PoolOptions: preallocate or growth is a
// best-fit pool's region policy, platform is no pool at all. Thread safe.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/device.h"
#include "core/memory/adaptors.h"
#include "core/memory/options.h"
#include "core/memory/resource.h"
#include "core/memory/step_plan_resource.h"
#include "core/slab.h"
#include "core/spin_lock.h"
#include "core/ptr_map.h"
#include "core/stream.h"
#include "core/units.h"

namespace replica {

class BestFitPool;

struct PoolStats {
  size_t in_use = 0;         // bytes handed out (rounded to the granularity)
  size_t requested = 0;      // bytes asked for (unrounded)
  size_t peak_in_use = 0;
  size_t reserved = 0;       // bytes taken from the upstream
  size_t peak_reserved = 0;
  size_t capacity = 0;       // the most this pool may reserve
  size_t largest_free = 0;   // largest block that one allocation could get without growing
  size_t total_free = 0;     // free without asking the upstream for more (MemoryInfo::free)
  double fragmentation = 0;  // 1 - largest_free / total_free (0 when nothing is free)
  size_t allocs = 0, frees = 0, ooms = 0, regions = 0, upstream_calls = 0;
  std::array<TagStats, kNumTags> tags{};
};

class MemoryPool {
 public:
  static constexpr size_t kGranularity = kMemoryGranularity;

  MemoryPool(Device device, std::unique_ptr<Upstream> upstream, PoolOptions options);
  ~MemoryPool();
  MemoryPool(const MemoryPool&) = delete;
  MemoryPool& operator=(const MemoryPool&) = delete;

  // Returns 256-byte aligned memory; throws OutOfMemoryError (pool stays usable). The block
  // belongs to `stream` (default: the thread's current stream) for stream ordering, see
  // BestFitPool; synchronous (CPU) streams order nothing.
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

  // Step planning (preallocate and growth modes), see StepPlanResource.
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
  struct Live {
    Allocation a;
    AllocRequest r;
    const char* site = nullptr;  // the layer (or phase) that allocated it, for leak reports
  };
  // Stacks the layers in use: the step plan while one is recorded or served, the trace while
  // one is attached; statistics and the OOM adaptor always.
  void restack();
  bool plan_in_stack_ = false, trace_in_stack_ = false;

  Device device_;
  PoolOptions options_;
  size_t capacity_ = 0, total_ = 0;
  std::string upstream_name_;

  // The stack, bottom first; the front sends requests to oom_, the top.
  std::unique_ptr<LimitedUpstream> limited_;
  std::unique_ptr<MemoryResource> base_;  // BestFitPool or DirectResource
  std::unique_ptr<StepPlanResource> plan_;
  std::unique_ptr<TraceAdaptor> trace_;
  std::unique_ptr<StatisticsAdaptor> stats_;
  std::unique_ptr<OomAdaptor> oom_;

  mutable detail::SpinLock mu_;
  detail::PtrMap<Live*> live_;
  detail::Slab<Live> live_records_;
};

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

// Counts the calling thread's allocations from one pool while it lives; other threads' (a loader
// prefetching batches into the same pool) are not counted. A captured training step must take
// nothing from the replica's pool (train/step_graph.h): this is how it is held to that.
class ThreadAllocationCount {
 public:
  explicit ThreadAllocationCount(const MemoryPool& pool);
  ~ThreadAllocationCount();
  ThreadAllocationCount(const ThreadAllocationCount&) = delete;
  ThreadAllocationCount& operator=(const ThreadAllocationCount&) = delete;
  size_t count() const { return count_; }

 private:
  friend class MemoryPool;
  const MemoryPool* pool_;
  size_t count_ = 0;
  ThreadAllocationCount* previous_;
};

}  // namespace replica
