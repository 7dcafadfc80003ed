// Adaptors of the memory stack (RMM's statistics_/logging_/failure_callback_resource_adaptor):
// each adds one concern above the resource below it and forwards everything else.
#pragma once
#include <array>
#include <functional>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/memory/options.h"
#include "core/memory/resource.h"

namespace replica {

class AllocTrace;

struct TagStats {
  size_t in_use = 0, peak_in_use = 0;
  size_t allocs = 0;
};

// Peak and count over a phase (push_scope ... pop_scope).
struct ScopeStats {
  size_t start_in_use = 0, peak_in_use = 0, end_in_use = 0, allocs = 0;
  size_t peak_delta() const { return peak_in_use - start_in_use; }
};

// What was handed out through this adaptor: bytes in use, peaks and counts, split by tag.
struct UsageStats {
  size_t in_use = 0;      // bytes handed out (rounded to the granularity)
  size_t requested = 0;   // bytes asked for (unrounded)
  size_t peak_in_use = 0;
  size_t allocs = 0, frees = 0;
  std::array<TagStats, kNumTags> tags{};
};

class StatisticsAdaptor final : public ResourceAdaptor {
 public:
  using ResourceAdaptor::ResourceAdaptor;
  Allocation allocate(const AllocRequest& r) override;
  void deallocate(const Allocation& a, const AllocRequest& r) override;
  void reset_peaks() override;
  const UsageStats& usage() const { return st_; }
  void push_scope();
  ScopeStats pop_scope();  // throws Error without a push_scope

 private:
  UsageStats st_;
  std::vector<ScopeStats> scopes_;
};

// Records every allocation and free into an AllocTrace (not owned), labelled with the step.
class TraceAdaptor final : public ResourceAdaptor {
 public:
  using ResourceAdaptor::ResourceAdaptor;
  Allocation allocate(const AllocRequest& r) override;
  void deallocate(const Allocation& a, const AllocRequest& r) override;
  void set_trace(AllocTrace* trace) { trace_ = trace; }
  void set_step(int64_t step) { step_ = step; }

 private:
  AllocTrace* trace_ = nullptr;
  int64_t step_ = 0;
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

// Turns a failed allocation into an OutOfMemoryError that says what was asked, what the pool
// holds (the biggest tags, from `usage`), whether it is fragmentation, and ends with the advice
// of whoever owns the pool (RMM's failure_callback_resource_adaptor).
class OomAdaptor final : public ResourceAdaptor {
 public:
  OomAdaptor(MemoryResource* below, const StatisticsAdaptor* usage, Device device, PoolOptions options)
      : ResourceAdaptor(below), usage_(usage), device_(device), options_(std::move(options)) {}
  // Inline: the front calls it for every allocation, and it only forwards until one fails.
  Allocation allocate(const AllocRequest& r) override {
    const Allocation a = below_->allocate(r);
    if (!a.ptr) fail(r);
    return a;
  }
  // Throws the out-of-memory error for `r` (also for requests made below, e.g. a step plan's arena).
  [[noreturn]] void fail(const AllocRequest& r);
  void set_advice(OomAdvice advice) { advice_ = std::move(advice); }
  size_t ooms() const { return ooms_; }

 private:
  const StatisticsAdaptor* usage_;
  Device device_;
  PoolOptions options_;
  OomAdvice advice_;
  size_t ooms_ = 0;
};

}  // namespace replica
