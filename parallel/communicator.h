// Communicator: the collectives data parallelism needs, per rank. Every collective has an async
// form returning a Work handle; collectives must be issued in the same order on every rank (as with
// NCCL). Implementations: HostCommunicator (CPU replicas in one process), MpiCommunicator,
// NcclCommunicator. Failures and time-outs throw CommError naming the rank; nothing hangs.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace replica {
class Stream;
}

namespace replica::parallel {

class CaptureHolds;

// The exit status of a process whose job lost a peer (a collective timed out, a process died):
// nothing it wrote is inconsistent, and the run continues with `replica train --resume RUN_DIR` on
// the machines that are left (sysexits' EX_TEMPFAIL; examples/elastic/resume-loop.sh restarts on it).
constexpr int kExitRestartable = 75;

enum class ReduceOp { sum, avg, max };
const char* reduce_op_name(ReduceOp op);

// A pending collective. wait() rethrows its failure.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual bool done() = 0;
  // Orders the later work of `s` (a replica's compute stream) after this collective. NCCL does it
  // on the device (the stream waits on the collective's event; the host returns at once), so a
  // step needs no host wait per bucket; communicators that compute on the host wait() here.
  virtual void order_before(Stream& s) { (void)s; wait(); }
  // Throws what wait() would throw when the collective has failed, timed out or was aborted, and
  // returns at once otherwise: a host waiting for a stream that was ordered after this work polls
  // it, so a failure still surfaces within the time-out instead of hanging in the device wait.
  virtual void check() {}
};
using WorkHandle = std::shared_ptr<Work>;

// A collective that finished before its call returned (solo and host-staged communicators).
class DoneWork : public Work {
 public:
  void wait() override {}
  bool done() override { return true; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;
  // True when buffers must be device memory (NCCL); host data then travels through
  // all_reduce_host / all_gather_host (parallel/gradient_sync.h).
  virtual bool device_buffers() const { return false; }
  // True when collectives read and write other processes' buffers in place (MPI's node
  // all-reduce, all processes on one machine): the pools then take memory those processes can
  // map (PoolOptions::shared_across_processes).
  virtual bool maps_peer_buffers() const { return false; }
  // "" when a CUDA graph captured on a replica's compute stream holds these collectives as its
  // own nodes (NCCL's kernels, from a loaded NCCL that can be captured); else why not: host
  // communicators and device buffers staged through the host have copies and host waits no graph
  // can hold.
  virtual std::string cuda_graph_refusal() const {
    return "the collectives of " + name() + " are not CUDA work a graph can hold";
  }
  // Where work captured with these collectives (a CUDA graph, a CPU recording) registers its
  // release: the group's abort and destruction release it first (parallel/capture_holds.h). Null
  // when nothing of the group's survives in captured work.
  virtual CaptureHolds* capture_holds() { return nullptr; }

  // In place over `count` elements of `dtype`. f32 sums in f32 (avg: the sum, then / size()).
  // 16-bit reductions (f16 / bf16) are 16-bit arithmetic on every communicator, as NCCL's ring
  // does: avg multiplies each contribution by 1/size() first (NCCL's ncclAvg), and the running sum
  // is rounded to the dtype after every addition. The order of the additions is rank order in a
  // process, then process order (host and MPI communicators), or NCCL's ring order (GPUs), so
  // results agree to within the rounding of size() - 1 16-bit additions, and exactly where those
  // are exact. A 16-bit wire trades that rounding for half the bytes (parallel.grad_dtype).
  virtual WorkHandle all_reduce_async(void* data, size_t count, DType dtype, ReduceOp op) = 0;
  virtual WorkHandle broadcast_async(void* data, size_t count, DType dtype, int root) = 0;
  // recv holds size() * count elements, rank r's contribution at r * count.
  virtual WorkHandle all_gather_async(const void* send, void* recv, size_t count, DType dtype) = 0;
  // send holds size() * count elements; rank r receives the reduction of block r.
  virtual WorkHandle reduce_scatter_async(const void* send, void* recv, size_t count, DType dtype,
                                          ReduceOp op) = 0;
  virtual WorkHandle barrier_async() = 0;

  // Uneven, in-place forms for sharded training state (ZeRO): `bounds` has size() + 1
  // non-decreasing entries from 0 to `count`, and rank r owns [bounds[r], bounds[r + 1]).
  // reduce_scatter_v: rank r's owned range receives each element's reduction with exactly the
  // bits all_reduce gives it (the same order of additions); nothing else in its buffer changes.
  // all_gather_v: every rank's buffer receives every owner's range; owned ranges are read only.
  // The defaults (host memory only) go through all_reduce / all_gather of the whole message (twice
  // the bytes of a true reduce-scatter, the same bits by construction); the host and NCCL
  // communicators override them with true ranged collectives.
  virtual WorkHandle reduce_scatter_v_async(void* data, size_t count, DType dtype, ReduceOp op,
                                            const std::vector<size_t>& bounds);
  virtual WorkHandle all_gather_v_async(void* data, size_t count, DType dtype, const std::vector<size_t>& bounds);

  // Stops every pending and future collective on every rank with CommError(why).
  virtual void abort(const std::string& why) = 0;

  // A Work for everything queued on `s` (a replica's compute stream) so far, the collectives of a
  // replayed CUDA graph among it: the step's host read polls it in place of the handles the
  // graph's capture made, which name no run of the graph (train/step_graph.h). NCCL records an
  // event on `s` and polls it as it polls its own collectives (an abort elsewhere in the clique,
  // NCCL's asynchronous error, the time-out from now); a communicator whose collectives are over
  // when their calls return has nothing pending. `what` names it in a failure (a literal).
  virtual WorkHandle stream_work(Stream& s, const char* what) {
    (void)s;
    (void)what;
    return std::make_shared<DoneWork>();
  }

  // Blocking forms. Implementations may run them on the calling thread (after any pending async
  // collectives), which saves two thread hand-offs per call.
  virtual void all_reduce(void* data, size_t count, DType dtype, ReduceOp op) {
    all_reduce_async(data, count, dtype, op)->wait();
  }
  virtual void broadcast(void* data, size_t count, DType dtype, int root) {
    broadcast_async(data, count, dtype, root)->wait();
  }
  virtual void all_gather(const void* send, void* recv, size_t count, DType dtype) {
    all_gather_async(send, recv, count, dtype)->wait();
  }
  virtual void reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
    reduce_scatter_async(send, recv, count, dtype, op)->wait();
  }
  virtual void barrier() { barrier_async()->wait(); }
  virtual void reduce_scatter_v(void* data, size_t count, DType dtype, ReduceOp op, const std::vector<size_t>& bounds) {
    reduce_scatter_v_async(data, count, dtype, op, bounds)->wait();
  }
  virtual void all_gather_v(void* data, size_t count, DType dtype, const std::vector<size_t>& bounds) {
    all_gather_v_async(data, count, dtype, bounds)->wait();
  }

 protected:
  // Throws CommError unless `bounds` cuts [0, count) into size() ranges (see reduce_scatter_v).
  void check_bounds(const char* what, size_t count, const std::vector<size_t>& bounds) const;
  // The defaults' bodies, run on the calling thread (an implementation with a queue submits them).
  void reduce_scatter_v_by_all_reduce(void* data, size_t count, DType dtype, ReduceOp op,
                                      const std::vector<size_t>& bounds);
  void all_gather_v_by_all_gather(void* data, size_t count, DType dtype, const std::vector<size_t>& bounds);
};

}  // namespace replica::parallel
