// ShardPlan: how sharded training state (ZeRO stages 1 and 2) cuts the flat parameter space among
// R replicas. Rank r owns [bounds[r], bounds[r + 1]): its optimizer state, and in `gradients`
// mode the only part of the reduced gradient it receives. Cuts are balanced by bytes: on a
// gradient-bucket boundary where one lies within the tolerance (5%) of the even share, else on the
// nearest allowed point (a norm block edge, or a tensor edge for optimizers with per-tensor norms).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace replica::parallel {

enum class ShardMode { none, optimizer, gradients };
const char* shard_mode_name(ShardMode m);
// "none" | "optimizer" | "gradients"; anything else is a ConfigError naming `key`.
ShardMode parse_shard_mode(const std::string& s, const std::string& key);

struct ShardPlan {
  ShardMode mode = ShardMode::none;
  std::vector<int64_t> bounds;  // world + 1 offsets into the flat buffer, from 0 to its size

  bool sharded() const { return mode != ShardMode::none; }
  int world() const { return static_cast<int>(bounds.size()) - 1; }
  int64_t total() const { return bounds.empty() ? 0 : bounds.back(); }
  int64_t lo(int rank) const { return bounds[rank]; }
  int64_t hi(int rank) const { return bounds[rank + 1]; }
  // The bounds as a collective's `bounds` over the element range [lo, hi) (communicator.h).
  std::vector<size_t> within(int64_t lo, int64_t hi) const;
  // Largest shard over the even share total / world (1 is perfect balance).
  double imbalance() const;
};

// The plan for `total` elements over `world` ranks. `preferred` and `allowed` are sorted cut
// points in (0, total); an empty `allowed` allows any element. With ShardMode::none every rank
// owns everything's update but the plan still holds one shard (bounds {0, total} per rank is not
// meaningful): callers test sharded() first.
ShardPlan plan_shards(ShardMode mode, int64_t total, int world, const std::vector<int64_t>& preferred,
                      const std::vector<int64_t>& allowed, double tolerance = 0.05);

// The fixed blocks the global gradient norm is summed over: every tensor's start, every multiple
// of `block` elements, and the end, sorted. Partial squares per block, added in block order, give
// the same bits whatever the replica count and the sharding (each block lies inside one shard).
std::vector<int64_t> norm_blocks(const std::vector<int64_t>& slot_offsets, int64_t total, int64_t block = 4096);
// The segments (start, length) of norm_blocks' `blocks` from block `first` on that start below
// `hi`: what a replica sums the squares of (all of them unsharded; its own under ZeRO-2).
std::vector<std::pair<int64_t, int64_t>> norm_segments(const std::vector<int64_t>& blocks, int64_t first, int64_t hi);

}  // namespace replica::parallel
