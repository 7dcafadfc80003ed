// The memory resource interface every layer of a device's allocator implements (RMM's
// device_memory_resource, with a tag and a handle), and the upstreams at the bottom of the stack:
// where raw memory comes from (host pages, cudaMalloc, pinned host, a simulation for tests).
//
//   MemoryPool (front: lock, live table, sites)            core/memory_pool.h
//     -> OomAdaptor (failure -> OutOfMemoryError + advice) core/memory/adaptors.h
//     -> StatisticsAdaptor (tags, peaks, scopes)          core/memory/adaptors.h
//     -> TraceAdaptor (alloc/free events)                 core/memory/adaptors.h
//     -> StepPlanResource (a packed arena per step)       core/memory/step_plan_resource.h
//     -> BestFitPool (preallocate | growth policy)        core/memory/best_fit_pool.h
//        or DirectResource (platform: no pool)           core/memory/direct_resource.h
//     -> LimitedUpstream (capacity: bytes or fraction)    this file
//     -> HostUpstream / cudaMalloc / pinned / Simulated   this file, core/cuda/runtime.cu
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/stream.h"

namespace replica {

// What an allocation is for; stats are split by it. `data` is the loader's input batches (their
// number in flight depends on prefetch timing, so they are kept apart from activations).
enum class MemTag : uint8_t { params, grads, optimizer, activations, workspace, comm, data, other };
constexpr int kNumTags = 8;
const char* mem_tag_name(MemTag t);

// Every size a resource sees is a multiple of this (the front rounds).
constexpr size_t kMemoryGranularity = 256;

// One request as it travels down the stack; the same values come back with its free.
struct AllocRequest {
  size_t size = 0;       // rounded to kMemoryGranularity
  size_t requested = 0;  // as asked
  MemTag tag = MemTag::other;
  Stream* stream = nullptr;  // null: no stream ordering (CPU streams are synchronous)
};

// What a resource hands out: the memory and its own record of it (a pool's block), handed back
// on free so no layer needs a lookup of its own (Vulkan's VmaAllocation, in spirit).
struct Allocation {
  void* ptr = nullptr;
  void* handle = nullptr;
};

// The state of the bottom of the stack, computed in one place per resource.
struct MemoryInfo {
  size_t capacity = 0;       // the most that may be reserved (the limit)
  size_t reserved = 0;       // taken from the upstream
  size_t peak_reserved = 0;
  size_t free = 0;           // could be handed out without asking the upstream for more
  size_t largest_free = 0;   // the largest single request that fits without asking for more
  size_t headroom = 0;       // could be handed out at all, asking the upstream up to the limit
  size_t regions = 0;        // pieces taken from the upstream and held
  size_t upstream_calls = 0;
};

// A layer of the allocator. Not thread safe by itself: the front (MemoryPool) serialises calls.
class MemoryResource {
 public:
  virtual ~MemoryResource() = default;
  // {nullptr, ...} when the memory is not there; the OOM adaptor turns that into an error.
  virtual Allocation allocate(const AllocRequest& r) = 0;
  virtual void deallocate(const Allocation& a, const AllocRequest& r) = 0;
  // A live allocation is also used by `stream`: its free must wait for that stream's work too.
  virtual void record_stream(const Allocation& a, Stream* stream) = 0;
  virtual MemoryInfo info() const = 0;
  // Gives whole unused pieces back to the upstream; the bytes released.
  virtual size_t release_unused() = 0;
  // Peaks start again from the current values.
  virtual void reset_peaks() = 0;
};

// An adaptor forwards everything to the resource below; subclasses override what they add.
class ResourceAdaptor : public MemoryResource {
 public:
  explicit ResourceAdaptor(MemoryResource* below) : below_(below) {}
  Allocation allocate(const AllocRequest& r) override { return below_->allocate(r); }
  void deallocate(const Allocation& a, const AllocRequest& r) override { below_->deallocate(a, r); }
  void record_stream(const Allocation& a, Stream* s) override { below_->record_stream(a, s); }
  MemoryInfo info() const override { return below_->info(); }
  size_t release_unused() override { return below_->release_unused(); }
  void reset_peaks() override { below_->reset_peaks(); }
  // Restacks this adaptor on another resource (the front leaves optional layers out while they
  // have nothing to do, so an allocation pays only for the layers in use).
  void set_below(MemoryResource* below) { below_ = below; }

 protected:
  MemoryResource* below_;
};

// Where raw memory comes from (RMM's cuda_memory_resource and friends). Sizes are what the
// resource above asks; alignment is at least 256 bytes.
class Upstream {
 public:
  virtual ~Upstream() = default;
  // Returns nullptr when the memory is not available.
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p, size_t bytes) = 0;
  // The device's total memory, the base of `fraction`.
  virtual size_t total_memory() const = 0;
  virtual std::string name() const = 0;
  // How much more this upstream would give; SIZE_MAX when it does not know.
  virtual size_t available() const { return SIZE_MAX; }
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
  explicit SimulatedUpstream(size_t total, size_t available = SIZE_MAX)
      : total_(total), available_(std::min(total, available)) {}
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

// One block that belongs to someone else (a private pool carved out of a replica's pool, as
// train.cuda_graph's): handed out once, whole or in part from its start; the owner frees it.
class BlockUpstream : public Upstream {
 public:
  BlockUpstream(void* block, size_t bytes, std::string name) : block_(block), bytes_(bytes), name_(std::move(name)) {}
  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) override;
  size_t total_memory() const override { return bytes_; }
  std::string name() const override { return name_; }
  size_t available() const override { return taken_ ? 0 : bytes_; }

 private:
  void* block_;
  size_t bytes_;
  std::string name_;
  bool taken_ = false;
};

// Caps what may be taken from an upstream (RMM's limiting_resource_adaptor): the pool's
// capacity, `memory.bytes` or `fraction x total`, lives here and only here.
class LimitedUpstream : public Upstream {
 public:
  LimitedUpstream(std::unique_ptr<Upstream> inner, size_t limit) : inner_(std::move(inner)), limit_(limit) {}
  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) override;
  size_t total_memory() const override { return inner_->total_memory(); }
  std::string name() const override { return inner_->name(); }
  size_t available() const override { return limit_ - outstanding_; }
  size_t limit() const { return limit_; }
  size_t outstanding() const { return outstanding_; }
  size_t peak_outstanding() const { return peak_; }
  size_t calls() const { return calls_; }

 private:
  std::unique_ptr<Upstream> inner_;
  size_t limit_, outstanding_ = 0, peak_ = 0, calls_ = 0;
};

}  // namespace replica
