// StepPlanResource: recording, packing and serving one step's allocations.
#include "core/memory/step_plan_resource.h"

#include <algorithm>

#include "core/errors.h"
#include "core/lifetime_packing.h"

namespace replica {

StepPlanResource::~StepPlanResource() {
  if (arena_.ptr) below_->deallocate(arena_, arena_request_);
}

Allocation StepPlanResource::allocate(const AllocRequest& r) {
  const bool this_thread = (recording_ || serving_) && std::this_thread::get_id() == thread_;
  if (serving_ && !diverged_ && this_thread)
    if (void* p = serve(r)) return {p, nullptr};
  const Allocation a = below_->allocate(r);
  if (a.ptr && recording_ && this_thread) {
    rec_live_.insert(a.ptr, static_cast<int>(plan_.size()));
    plan_.push_back({r.size, r.tag, false, 0, {}});
    rec_life_.push_back({rec_clock_++, SIZE_MAX});
  }
  return a;
}

void StepPlanResource::deallocate(const Allocation& a, const AllocRequest& r) {
  if (mine(a.ptr)) {
    bool found = false;
    const int k = plan_live_.take(a.ptr, found);
    if (!found) throw Error("StepPlanResource: free of a planned block that is not alive");
    freed_[k] = 1;
    return;
  }
  if (recording_) {
    bool rec = false;
    const int k = rec_live_.take(a.ptr, rec);
    if (rec) rec_life_[k].second = rec_clock_++;
  }
  below_->deallocate(a, r);
}

void StepPlanResource::record_stream(const Allocation& a, Stream* s) {
  // A planned block's bytes are reused by the next step on the same thread's stream in order;
  // only blocks from below track other streams.
  if (!mine(a.ptr)) below_->record_stream(a, s);
}

void StepPlanResource::record_begin() {
  if (arena_.ptr) throw Error("StepPlanResource: clear() before recording a new plan");
  plan_.clear();
  rec_life_.clear();
  rec_clock_ = 0;
  thread_ = std::this_thread::get_id();
  recording_ = true;
}

bool StepPlanResource::record_end(AllocRequest* arena_request) {
  recording_ = false;
  rec_live_ = detail::PtrMap<int>();
  std::vector<LifetimeItem> items;
  std::vector<int> which;
  for (size_t k = 0; k < plan_.size(); ++k)
    if (rec_life_[k].second != SIZE_MAX) {  // freed within the step: plannable
      plan_[k].planned = true;
      items.push_back({plan_[k].size, rec_life_[k].first, rec_life_[k].second});
      which.push_back(static_cast<int>(k));
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
  // The arena is one block from below: reserved there, and not in use for the layers above until
  // a planned allocation inside it is handed out.
  if (arena) {
    arena_request_ = {std::max(kMemoryGranularity, (arena + kMemoryGranularity - 1) & ~(kMemoryGranularity - 1)),
                      arena, MemTag::other, nullptr};
    arena_ = below_->allocate(arena_request_);
    if (!arena_.ptr) {
      plan_.clear();
      *arena_request = arena_request_;
      return false;
    }
  }
  arena_size_ = arena;
  for (size_t i = 0; i < items.size(); ++i) plan_[which[i]].offset = items[i].offset;
  // For each planned allocation, the earlier ones it reuses bytes of must be freed first.
  for (size_t i = 0; i < items.size(); ++i)
    for (size_t j = 0; j < items.size(); ++j)
      if (items[j].end <= items[i].begin && items[j].offset < items[i].offset + items[i].size &&
          items[i].offset < items[j].offset + items[j].size)
        plan_[which[i]].must_be_free.push_back(which[j]);
  st_ = {};
  st_.active = arena_.ptr != nullptr;
  st_.arena_bytes = arena;
  st_.recorded_peak = static_cast<size_t>(peak);
  st_.planned = items.size();
  st_.unplanned = plan_.size() - items.size();
  return true;
}

void StepPlanResource::step_begin() {
  if (!arena_.ptr) return;
  thread_ = std::this_thread::get_id();
  serving_ = true;
  diverged_ = plan_live_.size() != 0;  // a planned block outlived its step: do not reuse the arena
  if (diverged_) st_.last_divergence = "a planned block from the previous step is still alive";
  next_ = 0;
  freed_.assign(plan_.size(), 0);
}

void* StepPlanResource::serve(const AllocRequest& r) {
  const size_t k = next_++;
  auto diverge = [&](const std::string& why) -> void* {
    diverged_ = true;
    st_.last_divergence = "allocation #" + std::to_string(k) + ": " + why;
    return nullptr;
  };
  if (k >= plan_.size()) return diverge("more allocations than the recorded step");
  const Item& it = plan_[k];
  if (it.size != r.size || it.tag != r.tag)
    return diverge(std::to_string(r.size) + " B of " + mem_tag_name(r.tag) + " where the plan has " +
                   std::to_string(it.size) + " B of " + mem_tag_name(it.tag));
  if (!it.planned) return nullptr;  // outlives the step: the resource below serves it, the plan goes on
  for (int j : it.must_be_free)
    if (!freed_[j]) return diverge("reuses the bytes of allocation #" + std::to_string(j) + ", not yet freed");
  char* p = static_cast<char*>(arena_.ptr) + it.offset;
  plan_live_.insert(p, static_cast<int>(k));
  return p;
}

void StepPlanResource::step_end() {
  if (!serving_) return;
  serving_ = false;
  if (!diverged_ && next_ != plan_.size()) {
    diverged_ = true;
    st_.last_divergence = "the step made " + std::to_string(next_) + " allocations, the plan " +
                          std::to_string(plan_.size());
  }
  if (diverged_) st_.steps_diverged++;
  else st_.steps_served++;
}

void StepPlanResource::clear() {
  if (plan_live_.size()) throw Error("MemoryPool::plan_clear while planned blocks are alive");
  if (arena_.ptr) below_->deallocate(arena_, arena_request_);
  arena_ = {};
  arena_size_ = 0;
  serving_ = recording_ = false;
  plan_.clear();
  st_ = {};
}

}  // namespace replica
