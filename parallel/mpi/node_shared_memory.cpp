// NodeAllReduce (see the header).
#include "parallel/mpi/node_shared_memory.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "core/env.h"
#include "core/errors.h"
#include "core/memory/shared_host_memory.h"
#include "parallel/accumulate.h"

namespace replica::parallel {

namespace {
// Three cache lines: the barrier counter and each half's shift; the published buffer; the claim
// counter (used in rank 0's segment), each on its own line so polling one does not slow another.
constexpr size_t kHeader = 192;
// A half is a chunk plus one page: its data starts where its address is half a page away from
// the caller's buffer modulo 4 KiB (the shift, in floats, published in the header), because a copy
// between addresses that agree in their low 12 bits runs at half speed (4K aliasing: measured
// 2.1-2.5 against 5-8 GB/s, depending on where the caller's buffer happened to lie).
constexpr size_t kPage = 4096;
constexpr size_t kHalf = NodeAllReduce::kChunkFloats * sizeof(float) + kPage;
constexpr size_t kSegment = kHeader + 2 * kHalf;

unsigned long long load(unsigned long long* c) {
  return std::atomic_ref<unsigned long long>(*c).load(std::memory_order_acquire);
}
// The published fields are written before a barrier and read after it (the barrier orders them).
void put(uint64_t& f, uint64_t v) { std::atomic_ref<uint64_t>(f).store(v, std::memory_order_relaxed); }
uint64_t get(uint64_t& f) { return std::atomic_ref<uint64_t>(f).load(std::memory_order_relaxed); }

}  // namespace

std::unique_ptr<NodeAllReduce> NodeAllReduce::create(MPI_Comm world, std::chrono::milliseconds timeout,
                                                     int local_replicas) {
  const bool off = !env_flag("REPLICA_MPI_SHM", true);
  int world_size = 0, node_size = 0, rank = 0;
  MPI_Comm_size(world, &world_size);
  MPI_Comm node;
  MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);  // key 0: world order
  MPI_Comm_size(node, &node_size);
  MPI_Comm_rank(node, &rank);
  // Every process must take the same branch: a job on several nodes sees a node smaller than the
  // world everywhere, but REPLICA_MPI_SHM may differ between processes, so agree on it.
  int all_local = node_size == world_size && !off, agreed = 0;
  MPI_Allreduce(&all_local, &agreed, 1, MPI_INT, MPI_MIN, world);
  if (!agreed) {
    MPI_Comm_free(&node);
    return nullptr;
  }
  void* base = nullptr;
  MPI_Win win;
  if (MPI_Win_allocate_shared(static_cast<MPI_Aint>(kSegment), 1, MPI_INFO_NULL, node, &base, &win) != MPI_SUCCESS)
    throw CommError("MPI: MPI_Win_allocate_shared of " + std::to_string(kSegment) + " bytes failed");
  MPI_Win_lock_all(MPI_MODE_NOCHECK, win);  // passive target for the whole lifetime (unified model)
  std::memset(base, 0, kHeader);
  MPI_Win_sync(win);
  MPI_Barrier(node);  // every counter is zero before anyone reads one
  return std::unique_ptr<NodeAllReduce>(new NodeAllReduce(node, win, rank, node_size, timeout, local_replicas));
}

NodeAllReduce::NodeAllReduce(MPI_Comm node, MPI_Win win, int rank, int size, std::chrono::milliseconds timeout,
                             int local)
    : node_(node), win_(win), rank_(rank), size_(size), local_(local), timeout_(timeout) {
  for (int q = 0; q < size_; ++q) {
    MPI_Aint bytes = 0;
    int unit = 0;
    void* p = nullptr;
    MPI_Win_shared_query(win_, q, &bytes, &unit, &p);
    char* c = static_cast<char*>(p);
    auto* f = reinterpret_cast<float*>(c + kHeader);
    auto* header = reinterpret_cast<unsigned long long*>(c);
    seg_.push_back({header, {header + 1, header + 2}, {f, f + kHalf / sizeof(float)},
                    reinterpret_cast<Published*>(c + 64), reinterpret_cast<unsigned long long*>(c + 128)});
  }
  mapped_.resize(size_);
  seen_released_.assign(size_, 0);
}

NodeAllReduce::~NodeAllReduce() {
  for (auto& m : mapped_)
    for (auto& [id, map] : m) unmap_peer_region(map.base, map.bytes);
  MPI_Win_unlock_all(win_);
  MPI_Win_free(&win_);
  MPI_Comm_free(&node_);
}

void NodeAllReduce::barrier(const std::string& what) {
  ++barriers_;
  std::atomic_ref<unsigned long long>(*seg_[rank_].counter).store(barriers_, std::memory_order_release);
  const auto t0 = std::chrono::steady_clock::now();
  for (int q = 0; q < size_; ++q) {
    for (unsigned spin = 0; load(seg_[q].counter) < barriers_; ++spin) {
      if ((spin & 1023) != 1023) continue;
      std::this_thread::yield();  // 2 processes on 2 cores: let the one we wait for run
      if (std::chrono::steady_clock::now() - t0 <= timeout_) continue;
      std::string who;  // node rank = world rank: the job is on this node alone
      for (int r = 0; r < size_; ++r) {
        if (load(seg_[r].counter) >= barriers_) continue;
        const int lo = r * local_, hi = lo + local_ - 1;
        who += std::string(who.empty() ? "" : "; ") + "process " + std::to_string(r) + " (global rank" +
               (lo == hi ? " " + std::to_string(lo) : "s " + std::to_string(lo) + "-" + std::to_string(hi)) +
               ") never reached it (its last was barrier #" + std::to_string(load(seg_[r].counter)) + ")";
      }
      char secs[32];
      std::snprintf(secs, sizeof secs, "%.1f", timeout_.count() / 1000.0);
      throw CommError("shared-memory " + what + ": timed out after " + secs + " s at barrier #" +
                      std::to_string(barriers_) + " waiting for another process: " + who + " (stopped, dead, or stuck in other work)");
    }
  }
}

float* NodeAllReduce::data(int q, int h) {
  return seg_[q].half[h] + std::atomic_ref<unsigned long long>(*seg_[q].shift[h]).load(std::memory_order_relaxed);
}

void NodeAllReduce::reduce_slice(int h, size_t lo, size_t hi, float* out, bool max) {
  constexpr size_t kBlock = 512;  // an L1-resident accumulator; the loops below vectorise
  float acc[kBlock];
  float* result = data(rank_, h);
  for (size_t b = lo; b < hi; b += kBlock) {
    const size_t m = std::min(kBlock, hi - b);
    for (int q = 0; q < size_; ++q) {  // rank order: the same bits on every process
      // This process's own term is read where it is: it never copied its slice in.
      const float* s = (q == rank_ ? out : data(q, h)) + b;
      if (q == 0)
        std::memcpy(acc, s, m * sizeof(float));
      else
        accumulate(acc, s, m, max);
    }
    std::memcpy(result + b, acc, m * sizeof(float));
    std::memcpy(out + b, acc, m * sizeof(float));
  }
}

void NodeAllReduce::all_reduce(float* d, size_t n, bool max, const std::string& what) {
  if (n == 0) return;  // the same n on every process: none of them takes part
  if (in_place(d, n, DType::f32, max, what)) {
    ++in_place_;
    return;
  }
  ++copied_;
  copy_through_window(d, n, max, what);
}

// Process q's region p mapped here (mapping it again if it was dropped); null if that fails.
char* NodeAllReduce::peer_base(int q, Published& p) {
  auto& m = mapped_[q];
  const uint64_t id = get(p.id);
  if (auto it = m.find(id); it != m.end()) return static_cast<char*>(it->second.base);
  const size_t bytes = get(p.bytes);
  void* base = map_peer_region(static_cast<int>(get(p.pid)),
                               static_cast<int>(get(p.fd)), bytes);
  if (!base) return nullptr;
  m[id] = {base, bytes};
  return static_cast<char*>(base);
}

bool NodeAllReduce::all_reduce16(void* d, size_t n, DType t, const std::string& what) {
  if (n == 0) return true;
  if (!in_place(d, n, t, false, what)) return false;
  ++in_place_;
  return true;
}

bool NodeAllReduce::in_place(void* d, size_t n, DType t, bool max, const std::string& what) {
  publish(d, n * dtype_size(t));
  barrier(what);
  std::vector<char*> bufs;
  if (!agree_on_buffers(d, what, &bufs)) return false;
  reduce_units(bufs, n, t, max);
  barrier(what);  // every buffer holds the whole result before any process returns
  return true;
}

void NodeAllReduce::publish(const void* d, size_t bytes) {
  SharedRegion region;
  const bool shared = find_shared_region(d, bytes, &region);
  Published& mine = *seg_[rank_].pub;
  put(mine.id, shared ? region.id : 0);
  put(mine.pid, static_cast<uint64_t>(region.pid));
  put(mine.fd, static_cast<uint64_t>(region.fd));
  put(mine.bytes, region.bytes);
  put(mine.offset, shared ? static_cast<uint64_t>(static_cast<const char*>(d) - region.base) : 0);
  put(mine.released, shared_regions_released());
}

// After the barrier that follows publish(), every process reads the same headers and holds the
// same agreed_ and refused_ sets, so all of them return the same; the headers are not written
// again before another barrier (the copy path has two per chunk, the in-place one ends with one).
bool NodeAllReduce::agree_on_buffers(void* d, const std::string& what, std::vector<char*>* bufs) {
  bool ask = false;
  for (int q = 0; q < size_; ++q) {
    const uint64_t id = get(seg_[q].pub->id);
    if (id == 0 || refused_.count({q, id})) return false;
    ask |= !agreed_.count({q, id});
  }
  drop_released_mappings();
  bufs->assign(size_, nullptr);
  bool ok = true;
  for (int q = 0; q < size_; ++q) {
    char* base = q == rank_ ? nullptr : peer_base(q, *seg_[q].pub);
    (*bufs)[q] = q == rank_ ? static_cast<char*>(d) : base ? base + get(seg_[q].pub->offset) : nullptr;
    ok &= (*bufs)[q] != nullptr;
  }
  if (!ask) {
    if (ok) return true;
    throw CommError("shared-memory " + what + ": could not map again another process's buffer, which this " +
                    "process had mapped before");
  }
  // A region not seen before: did every process map every other one?
  put(seg_[rank_].pub->ok, ok);
  barrier(what);
  bool all = true;
  for (int q = 0; q < size_; ++q) all &= get(seg_[q].pub->ok) != 0;
  for (int q = 0; q < size_; ++q) (all ? agreed_ : refused_).insert({q, get(seg_[q].pub->id)});
  return all;
}

// A process that gave regions back: its regions mapped here, but for the one it uses now, go.
void NodeAllReduce::drop_released_mappings() {
  for (int q = 0; q < size_; ++q) {
    const uint64_t released = get(seg_[q].pub->released), id = get(seg_[q].pub->id);
    if (q == rank_ || released == seen_released_[q]) continue;
    seen_released_[q] = released;
    for (auto it = mapped_[q].begin(); it != mapped_[q].end();) {
      if (it->first == id) {
        ++it;
        continue;
      }
      unmap_peer_region(it->second.base, it->second.bytes);
      it = mapped_[q].erase(it);
    }
  }
}

// Units claimed from one counter (fast processes take more), each reduced in rank order and
// written into every process's buffer.
void NodeAllReduce::reduce_units(const std::vector<char*>& bufs, size_t n, DType t, bool max) {
  const size_t esize = dtype_size(t), units = (n + kUnitFloats - 1) / kUnitFloats;
  std::atomic_ref<unsigned long long> claim(*seg_[0].claim);
  constexpr size_t kBlock = 512;  // an L1-resident accumulator
  float acc[kBlock], term[kBlock];
  uint16_t wire[kBlock];
  std::vector<float*> f32(static_cast<size_t>(size_));  // f32 sums: one pass, in registers
  for (int q = 0; q < size_; ++q) f32[q] = reinterpret_cast<float*>(bufs[q]);
  for (;;) {
    const size_t u = static_cast<size_t>(claim.fetch_add(1, std::memory_order_relaxed) - claimed_);
    if (u >= units) break;
    const size_t hi = std::min(n, (u + 1) * kUnitFloats);
    if (t == DType::f32 && !max) {
      sum_to_all(f32.data(), f32.data(), size_, u * kUnitFloats, hi - u * kUnitFloats, false);
      continue;
    }
    for (size_t b = u * kUnitFloats; b < hi; b += kBlock) {
      const size_t m = std::min(kBlock, hi - b), at = b * esize;
      if (t == DType::f32) {  // max (sums went through sum_to_all above)
        std::memcpy(acc, bufs[0] + at, m * sizeof(float));
        for (int q = 1; q < size_; ++q) accumulate(acc, reinterpret_cast<const float*>(bufs[q] + at), m, max);
        for (int q = 0; q < size_; ++q) std::memcpy(bufs[q] + at, acc, m * sizeof(float));
        continue;
      }
      // 16 bits: the running sum is rounded to the dtype after every addition, in rank order
      // (NCCL's semantics, as the MPI operator and the in-process communicator do it); the last
      // rounding is the store.
      convert(bufs[0] + at, t, acc, DType::f32, m);
      for (int q = 1; q < size_; ++q) {
        convert(bufs[q] + at, t, term, DType::f32, m);
        accumulate(acc, term, m, false);
        if (q + 1 < size_) round_to(acc, m, t);
      }
      convert(acc, DType::f32, wire, t, m);
      for (int q = 0; q < size_; ++q) std::memcpy(bufs[q] + at, wire, m * sizeof(uint16_t));
    }
  }
  claimed_ += units + static_cast<unsigned long long>(size_);  // every process's last claim fails once
}

void NodeAllReduce::copy_through_window(float* d, size_t n, bool max, const std::string& what) {
  for (size_t off = 0; off < n; off += kChunkFloats) {
    const size_t m = std::min(kChunkFloats, n - off);
    const int h = static_cast<int>(chunks_++ & 1);  // this half was last read two barriers ago
    auto slice = [&](int q) { return std::pair<size_t, size_t>{m * q / size_, m * (q + 1) / size_}; };
    // Half a page from d modulo 4 KiB, in whole cache lines; read by the others after the barrier.
    const uintptr_t gap = (reinterpret_cast<uintptr_t>(d + off) + kPage / 2 -
                           reinterpret_cast<uintptr_t>(seg_[rank_].half[h])) & (kPage - 64);
    std::atomic_ref<unsigned long long>(*seg_[rank_].shift[h]).store(gap / sizeof(float), std::memory_order_relaxed);
    float* mine = data(rank_, h);
    // In: the slices the others reduce (this process's own slice stays in d). At its own
    // slice's place the segment then receives the result, which the others copy out.
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      const auto [a, b] = slice(q);
      std::memcpy(mine + a, d + off + a, (b - a) * sizeof(float));
    }
    barrier(what);
    const auto [lo, hi] = slice(rank_);
    reduce_slice(h, lo, hi, d + off, max);
    barrier(what);
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      const auto [a, b] = slice(q);
      std::memcpy(d + off + a, data(q, h) + a, (b - a) * sizeof(float));
    }
  }
}

}  // namespace replica::parallel
