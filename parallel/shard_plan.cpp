// ShardPlan: cutting the flat buffer into balanced shards, and the gradient norm's fixed blocks.
#include "parallel/shard_plan.h"

#include <algorithm>
#include <cmath>

#include "core/errors.h"

namespace replica::parallel {

const char* shard_mode_name(ShardMode m) {
  switch (m) {
    case ShardMode::none: return "none";
    case ShardMode::optimizer: return "optimizer";
    case ShardMode::gradients: return "gradients";
  }
  return "?";
}

ShardMode parse_shard_mode(const std::string& s, const std::string& key) {
  if (s == "none") return ShardMode::none;
  if (s == "optimizer") return ShardMode::optimizer;
  if (s == "gradients") return ShardMode::gradients;
  throw ConfigError(key + ": '" + s + "' is not a sharding mode; use none, optimizer (ZeRO-1: optimizer state) or "
                    "gradients (ZeRO-2: optimizer state and reduced gradients)");
}

std::vector<size_t> ShardPlan::within(int64_t a, int64_t e) const {
  std::vector<size_t> out;
  out.reserve(bounds.size());
  for (int64_t b : bounds) out.push_back(static_cast<size_t>(std::clamp(b, a, e) - a));
  return out;
}

double ShardPlan::imbalance() const {
  if (world() < 1 || total() == 0) return 1;
  int64_t most = 0;
  for (int r = 0; r < world(); ++r) most = std::max(most, hi(r) - lo(r));
  return static_cast<double>(most) * world() / static_cast<double>(total());
}

namespace {
// The cut point in `c` nearest to `target` that is at least `floor` (-1 when there is none).
int64_t nearest(const std::vector<int64_t>& c, double target, int64_t floor) {
  auto it = std::lower_bound(c.begin(), c.end(), static_cast<int64_t>(std::floor(target)));
  int64_t best = -1;
  double gap = 0;
  for (auto j : {it, it == c.begin() ? it : std::prev(it)}) {
    if (j == c.end() || *j < floor) continue;
    const double g = std::abs(static_cast<double>(*j) - target);
    if (best < 0 || g < gap) best = *j, gap = g;
  }
  if (best < 0 && it != c.end()) {  // everything near is below the floor: the first above it
    auto up = std::lower_bound(c.begin(), c.end(), floor);
    if (up != c.end()) best = *up;
  }
  return best;
}
}  // namespace

ShardPlan plan_shards(ShardMode mode, int64_t total, int world, const std::vector<int64_t>& preferred,
                      const std::vector<int64_t>& allowed, double tolerance) {
  if (world < 1) throw Error("plan_shards: world size must be >= 1");
  ShardPlan p;
  p.mode = mode;
  p.bounds.assign(static_cast<size_t>(world) + 1, 0);
  p.bounds.back() = total;
  const double share = static_cast<double>(total) / world;
  for (int r = 1; r < world; ++r) {
    const double target = share * r;
    const int64_t floor = p.bounds[r - 1];
    int64_t cut = nearest(preferred, target, floor);
    if (cut < 0 || std::abs(static_cast<double>(cut) - target) > tolerance * share) {
      cut = allowed.empty() ? static_cast<int64_t>(std::llround(target)) : nearest(allowed, target, floor);
      if (cut < 0) cut = total;  // no allowed point left: the later ranks own nothing
    }
    p.bounds[r] = std::clamp(cut, floor, total);
  }
  return p;
}

std::vector<std::pair<int64_t, int64_t>> norm_segments(const std::vector<int64_t>& blocks, int64_t first, int64_t hi) {
  std::vector<std::pair<int64_t, int64_t>> out;
  const int64_t n = static_cast<int64_t>(blocks.size()) - 1;
  for (int64_t k = first; k < n && blocks[k] < hi; ++k) out.push_back({blocks[k], blocks[k + 1] - blocks[k]});
  return out;
}

std::vector<int64_t> norm_blocks(const std::vector<int64_t>& slot_offsets, int64_t total, int64_t block) {
  std::vector<int64_t> b(slot_offsets.begin(), slot_offsets.end());
  for (int64_t at = 0; at < total; at += block) b.push_back(at);
  b.push_back(total);
  b.push_back(0);
  std::sort(b.begin(), b.end());
  b.erase(std::unique(b.begin(), b.end()), b.end());
  while (!b.empty() && b.back() > total) b.pop_back();
  return b;
}

}  // namespace replica::parallel
