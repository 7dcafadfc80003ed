// ReplicaGroup is pmap: one persistent thread per replica, bound to its device (and pinned to a
// core for CPU replicas), each owning its pool, stream and communicator. run(fn) calls fn on every
// replica at once and returns when all are done; an exception in one replica aborts the
// communicator (so the others stop instead of hanging) and surfaces in the caller with its rank.
#pragma once
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/errors.h"
#include "core/memory_pool.h"
#include "core/stream.h"
#include "parallel/communicator.h"

namespace replica::parallel {

class Replica {
 public:
  int rank() const { return rank_; }            // global rank (over all processes)
  int local_index() const { return local_; }     // index among this process's replicas
  int world() const { return comm_->size(); }
  const Device& device() const { return device_; }
  MemoryPool& pool() { return *pool_; }
  Stream& stream() { return *stream_; }  // compute
  // Host-to-device input copies overlap compute here (GPU replicas; null on CPU).
  Stream* copy_stream() { return copy_stream_.get(); }
  Communicator& comm() { return *comm_; }
  const Communicator& comm() const { return *comm_; }
  // The latency lane, where sync-BN's small all-reduces go: on GPUs a second NCCL communicator on
  // a high-priority stream when GroupOptions::latency_lane asked for one, so they do not queue
  // behind the gradient buckets on the first one's stream; otherwise the communicator itself.
  Communicator& lane() { return lane_ ? *lane_ : *comm_; }
  const Communicator& lane() const { return lane_ ? *lane_ : *comm_; }
  bool has_lane() const { return lane_ != nullptr; }
  // Sums `n` floats across replicas in place, ordered on the compute stream: device memory on a
  // GPU replica goes through the lane with no host round trip (the compute stream waits for the
  // collective on the device); host memory and CPU replicas reduce before returning.
  void psum_on_stream(float* data, size_t n);
  // Aborts the communicator and the lane (idempotent): the other replicas fail within seconds.
  void abort(const std::string& why);

  // pmap-style helpers over f32 buffers, in place, in host or device memory (host data on a GPU
  // replica travels through a device copy).
  void psum(float* data, size_t n) { reduce(data, n, ReduceOp::sum); }
  void pmean(float* data, size_t n) { reduce(data, n, ReduceOp::avg); }
  // Every replica's `n` floats (host or device memory), gathered to the host in rank order.
  std::vector<float> all_gather(const float* data, size_t n);

 private:
  friend class ReplicaGroup;
  void reduce(float* data, size_t n, ReduceOp op);
  int rank_ = 0, local_ = 0;
  Device device_;
  std::unique_ptr<MemoryPool> pool_;
  std::unique_ptr<Stream> stream_, copy_stream_;
  std::unique_ptr<Communicator> comm_, lane_;
};

// A failure in one replica, with its rank and the original exception (its type and fields
// survive the crossing from the replica thread: an out-of-memory stays an OutOfMemoryError).
class ReplicaError : public Error {
 public:
  ReplicaError(int rank, const std::string& msg, std::exception_ptr cause = nullptr)
      : Error(msg), rank_(rank), cause_(std::move(cause)) {}
  int rank() const { return rank_; }
  std::exception_ptr cause() const { return cause_; }
  // The original exception when it is an E (e.g. OutOfMemoryError), else null.
  template <class E>
  const E* cause_as() const {
    if (!cause_) return nullptr;
    try {
      std::rethrow_exception(cause_);
    } catch (const E& e) {
      return &e;  // the exception object lives as long as cause_ holds it
    } catch (...) {
    }
    return nullptr;
  }

 private:
  int rank_;
  std::exception_ptr cause_;
};

struct GroupOptions {
  PoolOptions cpu_pool;   // pool settings for CPU replicas
  PoolOptions cuda_pool;  // and for GPU replicas
  std::chrono::milliseconds comm_timeout{std::chrono::seconds(300)};
  bool pin_threads = true;  // pin CPU replica i to core i (when there are enough cores)
  // A single GPU replica without MPI gets the solo communicator instead of a one-rank NCCL one
  // (the NCCL tests and benchmarks turn this off).
  bool solo_single_gpu = true;
  // GPU replicas get a second NCCL communicator for small latency-bound collectives (sync-BN),
  // when the NCCL loaded can order two communicators per device (2.26+; else a warning and none).
  bool latency_lane = false;
};

class ReplicaGroup {
 public:
  ReplicaGroup(const std::vector<Device>& devices, GroupOptions opts);
  ~ReplicaGroup();
  ReplicaGroup(const ReplicaGroup&) = delete;
  ReplicaGroup& operator=(const ReplicaGroup&) = delete;

  // Replicas of this process (all of them unless launched by mpirun / srun).
  int size() const { return static_cast<int>(replicas_.size()); }
  Replica& replica(int local_index) { return *replicas_[local_index]; }
  int world() const { return replicas_.front()->world(); }
  int process_rank() const { return process_rank_; }
  int processes() const { return processes_; }
  // The process that holds global rank 0: it alone prints, logs and writes checkpoints.
  bool lead_process() const { return process_rank_ == 0; }

  // Runs fn(replica) on every replica thread of this process and waits. Throws ReplicaError for
  // the first replica that failed (failures caused only by that abort are not reported again).
  // Under MPI every process calls run() with the same function: collectives span all of them.
  void run(const std::function<void(Replica&)>& fn);
  // Global ranks of this process whose last run() failed with an error of their own (not the
  // communication error another replica's abort caused): one rank is a lost replica; every rank
  // failing alike (a diverged loss, a bad label) is the run's own problem.
  const std::vector<int>& last_failures() const { return own_failures_; }

 private:
  void worker(int r);

  std::vector<std::unique_ptr<Replica>> replicas_;
  std::vector<std::thread> threads_;
  std::mutex m_;
  std::condition_variable cv_start_, cv_done_;
  const std::function<void(Replica&)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int running_ = 0;
  bool stop_ = false;
  bool broken_ = false;
  std::vector<std::exception_ptr> errors_;
  std::vector<int> error_order_;
  std::vector<int> own_failures_;
  bool pin_ = true;
  int process_rank_ = 0, processes_ = 1;
  int node_slot_ = 0;  // this process's index among the job's processes on this node
};

}  // namespace replica::parallel
