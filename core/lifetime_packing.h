// Lifetime-aware packing: given allocations as (size, [begin, end)) intervals in time, assign
// offsets so that no two allocations alive at the same time overlap, greedily placing the largest
// first at the lowest free offset (TFLite's arena planner). Used by the step-planned pool and by
// `replica bench alloc` to show what a plan reaches.
#pragma once
#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace replica {

struct LifetimeItem {
  size_t size = 0, begin = 0, end = 0;  // alive in [begin, end)
  size_t offset = 0;                    // output
};

// Fills offsets; returns the arena size.
inline size_t pack_lifetimes(std::vector<LifetimeItem>& items) {
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return items[a].size > items[b].size; });
  std::vector<size_t> placed;
  size_t arena = 0;
  std::vector<std::pair<size_t, size_t>> busy;
  for (size_t idx : order) {
    auto& it = items[idx];
    busy.clear();
    for (size_t p : placed) {
      const auto& q = items[p];
      if (q.begin < it.end && it.begin < q.end) busy.push_back({q.offset, q.offset + q.size});
    }
    std::sort(busy.begin(), busy.end());
    size_t off = 0;
    for (auto& [b, e] : busy) {
      if (off + it.size <= b) break;
      off = std::max(off, e);
    }
    it.offset = off;
    arena = std::max(arena, off + it.size);
    placed.push_back(idx);
  }
  return arena;
}

}  // namespace replica
