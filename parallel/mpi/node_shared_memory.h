// NodeAllReduce: the all-reduce between the MPI processes of one machine over an MPI-3 shared
// window (MPI_Win_allocate_shared), the way NCCL's and Gloo's shared-memory transports go around
// the MPI library's own reduction (OpenMPI's reached 0.07-0.21x of the in-process path here).
//
// In place, when every process's buffer lies in memory the others can map (an MPI job's CPU
// pools, core/memory/shared_host_memory.h): each process publishes where its buffer is, maps the
// others' once (every process agrees on whether that worked), and the processes then reduce
// 64 KiB units claimed from a counter, reading every buffer and writing the sum into every
// buffer, as the in-process communicator does between threads: no copy at all.
//
// Copied otherwise (a buffer outside a pool): each process copies into its segment the slices
// of a chunk that the others reduce; after a barrier each reduces its own slice (its own term
// read in place, the others' from their segments) into its output and its segment; after a
// second barrier each copies the other slices' results out. Chunks alternate between two halves
// of each segment, so two barriers per chunk suffice.
//
// Both reduce in rank order, so every process gets the same bits, on either path. Barriers are
// counters in the window, polled with the communicator's time-out: a dead or stuck peer ends in
// an error that names it.
#pragma once
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"

namespace replica::parallel {

class NodeAllReduce {
 public:
  // Collective over `world`. Null (and no window) when the processes are not all on one node,
  // or REPLICA_MPI_SHM=0; the caller then uses MPI's own collectives.
  // `local_replicas` per process names global ranks in errors.
  static std::unique_ptr<NodeAllReduce> create(MPI_Comm world, std::chrono::milliseconds timeout,
                                               int local_replicas);
  ~NodeAllReduce();
  NodeAllReduce(const NodeAllReduce&) = delete;
  NodeAllReduce& operator=(const NodeAllReduce&) = delete;

  // In place over every process's `n` floats: the sum, or the maximum. Throws CommError on a
  // time-out, naming the processes that never reached the barrier (`what` names the collective).
  void all_reduce(float* d, size_t n, bool max, const std::string& what);

  // A 16-bit (f16 / bf16) sum in place, when every process's buffer is in shared pool memory;
  // false (having done nothing, on every process alike) when not, and the caller uses MPI's.
  bool all_reduce16(void* d, size_t n, DType t, const std::string& what);

  // How many all-reduces went each way, for tests and the bench.
  uint64_t in_place_count() const { return in_place_; }
  uint64_t copied_count() const { return copied_; }

  // In place: the elements of a unit of work claimed at a time (64 KiB of f32, the in-process
  // communicator's unit).
  static constexpr size_t kUnitFloats = size_t(1) << 14;
  // 256 KiB per half of a segment: the chunk stays in L2 from copy-in to reduce (measured
  // 4.9-7.9 GB/s at 8-32 MiB against 2.3-5.2 with 1 MiB chunks, bench/RESULTS.md).
  static constexpr size_t kChunkFloats = size_t(1) << 16;

 private:
  NodeAllReduce(MPI_Comm node, MPI_Win win, int rank, int size, std::chrono::milliseconds timeout, int local);
  // Where a process's buffer is, for the in-place path (a header line of its segment).
  struct Published {
    uint64_t id, pid, fd, bytes, offset;  // id 0: not in a shared region
    uint64_t released;                    // its shared_regions_released()
    uint64_t ok;                          // it mapped every other buffer (when asked)
  };
  struct Segment {
    unsigned long long* counter;   // barriers this process has reached
    unsigned long long* shift[2];  // where each half's data starts, in floats from half[h]
    float* half[2];
    Published* pub;
    unsigned long long* claim;     // rank 0's: the in-place units claimed so far, ever
  };
  float* data(int q, int h);
  void barrier(const std::string& what);
  void reduce_slice(int h, size_t lo, size_t hi, float* out, bool max);
  // The in-place path, in its steps; false (on every process alike) when it cannot be taken.
  bool in_place(void* d, size_t n, DType t, bool max, const std::string& what);
  void publish(const void* d, size_t bytes);
  bool agree_on_buffers(void* d, const std::string& what, std::vector<char*>* bufs);
  void drop_released_mappings();
  void reduce_units(const std::vector<char*>& bufs, size_t n, DType t, bool max);
  void copy_through_window(float* d, size_t n, bool max, const std::string& what);
  char* peer_base(int q, Published& p);

  struct Mapping {
    void* base;
    size_t bytes;
  };
  std::vector<std::map<uint64_t, Mapping>> mapped_;  // per process: its regions mapped here, by id
  std::vector<uint64_t> seen_released_;
  // (process, region id) pairs every process has mapped, or some process could not: the same
  // sets on every process, so every process picks the same path.
  std::set<std::pair<int, uint64_t>> agreed_, refused_;
  unsigned long long claimed_ = 0;  // the claim counter's value when the next collective starts
  uint64_t in_place_ = 0, copied_ = 0;

  MPI_Comm node_;
  MPI_Win win_;
  int rank_, size_, local_;
  std::chrono::milliseconds timeout_;
  std::vector<Segment> seg_;
  unsigned long long barriers_ = 0, chunks_ = 0;
};

}  // namespace replica::parallel
