// StepPlanResource: step-planned allocation (ggml's split of planning from memory). What a
// training step allocates repeats exactly from step to step, so one recorded step is packed
// offline into one arena (lifetime-aware offsets) and later steps are served from it in O(1).
// Only the planning thread's allocations are recorded and served; anything else (a loader
// thread, a block that outlives the step, a step that differs) goes to the resource below.
#pragma once
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/memory/resource.h"
#include "core/ptr_map.h"

namespace replica {

struct StepPlanStats {
  bool active = false;          // a plan exists
  size_t arena_bytes = 0;       // the block its offsets live in
  size_t recorded_peak = 0;     // peak live bytes of the planned allocations when recorded
  size_t planned = 0, unplanned = 0;  // allocations of the recorded step served by / outside the plan
  int64_t steps_served = 0;     // steps served entirely from the plan
  int64_t steps_diverged = 0;   // steps that left the plan (and fell back to best-fit)
  std::string last_divergence;  // why, the last time
};

class StepPlanResource final : public ResourceAdaptor {
 public:
  using ResourceAdaptor::ResourceAdaptor;
  ~StepPlanResource() override;
  Allocation allocate(const AllocRequest& r) override;
  void deallocate(const Allocation& a, const AllocRequest& r) override;
  void record_stream(const Allocation& a, Stream* s) override;

  //   record_begin(); <one step>; record_end();   // pack the step's allocations
  //   step_begin(); <a step>; step_end();         // serve them
  // An allocation that differs from the recording (size, tag, order, or a block the plan reuses
  // not yet freed) ends the plan for that step: it and the rest go below.
  void record_begin();
  // Packs the recording and takes the arena from below. False (and no plan) when the arena does
  // not fit; `*arena_request` then says what was asked, for the out-of-memory error.
  bool record_end(AllocRequest* arena_request);
  void step_begin();
  void step_end();
  void clear();  // throws Error while planned blocks are alive
  const StepPlanStats& stats() const { return st_; }

 private:
  struct Item {
    size_t size = 0;
    MemTag tag = MemTag::other;
    bool planned = false;  // freed within the step: lives in the arena
    size_t offset = 0;
    std::vector<int> must_be_free;  // earlier items sharing its bytes
  };
  bool mine(const void* p) const {
    return arena_.ptr && static_cast<const char*>(p) >= static_cast<const char*>(arena_.ptr) &&
           static_cast<const char*>(p) < static_cast<const char*>(arena_.ptr) + arena_size_;
  }
  void* serve(const AllocRequest& r);

  std::thread::id thread_;
  bool recording_ = false, serving_ = false, diverged_ = false;
  std::vector<Item> plan_;
  std::vector<std::pair<size_t, size_t>> rec_life_;  // [begin, end) per recorded item
  detail::PtrMap<int> rec_live_, plan_live_;
  size_t rec_clock_ = 0, next_ = 0;
  std::vector<char> freed_;
  Allocation arena_;
  AllocRequest arena_request_;
  size_t arena_size_ = 0;
  StepPlanStats st_;
};

}  // namespace replica
