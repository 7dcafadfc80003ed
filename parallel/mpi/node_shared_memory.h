// NodeAllReduce: the all-reduce between the MPI processes of one machine through an MPI-3 shared
// window (MPI_Win_allocate_shared), the way NCCL's and Gloo's shared-memory transports go around
// the MPI library's own reduction (OpenMPI's reached 0.07-0.21x of the in-process path here).
// Each process copies into its segment the slices of a chunk that the others reduce; after a
// barrier each reduces its own slice (its own term read in place, the others' from their
// segments, in rank order so every process gets the same bits) into its output and its segment;
// after a second barrier each copies the other slices' results out. Chunks alternate between two halves of
// each segment, so two barriers per chunk suffice. Barriers are counters in the window, polled
// with the communicator's time-out: a dead or stuck peer ends in an error that names it.
#pragma once
#include <mpi.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

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

  // 256 KiB per half of a segment: the chunk stays in L2 from copy-in to reduce (measured
  // 4.9-7.9 GB/s at 8-32 MiB against 2.3-5.2 with 1 MiB chunks, bench/RESULTS.md).
  static constexpr size_t kChunkFloats = size_t(1) << 16;

 private:
  NodeAllReduce(MPI_Comm node, MPI_Win win, int rank, int size, std::chrono::milliseconds timeout, int local);
  struct Segment {
    unsigned long long* counter;   // barriers this process has reached
    unsigned long long* shift[2];  // where each half's data starts, in floats from half[h]
    float* half[2];
  };
  float* data(int q, int h);
  void barrier(const std::string& what);
  void reduce_slice(int h, size_t lo, size_t hi, float* out, bool max);

  MPI_Comm node_;
  MPI_Win win_;
  int rank_, size_, local_;
  std::chrono::milliseconds timeout_;
  std::vector<Segment> seg_;
  unsigned long long barriers_ = 0, chunks_ = 0;
};

}  // namespace replica::parallel
