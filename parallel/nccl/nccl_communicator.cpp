// NcclCommunicator implementation (built when CUDA is).
#include "parallel/nccl/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "core/cuda/check.h"
#include "core/cuda/device_guard.h"
#include "core/errors.h"
#include "parallel/comm_clique.h"
#include "parallel/mpi/mpi_communicator.h"

#ifdef REPLICA_WITH_MPI
#include <mpi.h>
#endif

namespace replica::parallel {

bool nccl_compiled() { return true; }

bool nccl_has_comm_shrink() {
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
  return true;
#else
  return false;
#endif
}

int nccl_loaded_version() {
  int v = 0;
  return ncclGetVersion(&v) == ncclSuccess ? v : 0;
}

bool nccl_shares_gpus() { return nccl_loaded_version() >= 23000; }

std::string nccl_sharing_report() {
  if (nccl_shares_gpus())
    return "replicas sharing a GPU (cuda:0x2) run as NCCL ranks on it (NCCL_MULTI_RANK_GPU_ENABLE)";
  return "replicas sharing a GPU (cuda:0x2) stage their collectives through host memory (NCCL ranks sharing a GPU "
         "need NCCL 2.30 or later)";
}

std::string nccl_graph_refusal() {
  // The library loaded at run time decides, not the header built against: a process may load
  // an older libnccl than the toolkit's (LD_LIBRARY_PATH, a Python wheel's copy).
  constexpr int kMin = 20906;  // NCCL 2.9.6: collectives captured in CUDA graphs
  const int v = nccl_loaded_version();
  if (v >= kMin) return "";
  return nccl_version() + " is loaded; capturing its collectives in a CUDA graph needs NCCL 2.9.6 or later";
}

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "NCCL: version unknown";
  // NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z since 2.9
  return "NCCL " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

namespace {

#define REPLICA_NCCL_CHECK(expr)                                                                      \
  do {                                                                                                \
    ncclResult_t r_ = (expr);                                                                         \
    if (r_ != ncclSuccess)                                                                            \
      throw ::replica::CommError(std::string(#expr) + " failed: " + ncclGetErrorString(r_) + " at " + \
                                 __FILE__ + ":" + std::to_string(__LINE__));                          \
  } while (0)

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::u8: return ncclUint8;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::max: return ncclMax;
  }
  return ncclSum;
}

// The NCCL side of a CommClique: the process's communicators of one group, aborted together and
// destroyed together (ncclCommFinalize of all inside one group, then ncclCommDestroy of each:
// with one thread owning several ranks, finalizing them one by one would wait forever).
struct NcclClique {
  std::vector<ncclComm_t> comms;
  std::vector<int> devices;
  std::shared_ptr<CommClique> state;
  bool across_processes = false;  // other processes hold ranks too: an abort takes the MPI job down
  NcclClique(std::vector<ncclComm_t> c, std::vector<int> d) : comms(std::move(c)), devices(std::move(d)) {
    state = std::make_shared<CommClique>(
        static_cast<int>(comms.size()),
        CommClique::Backend{[this](int m) {
                              cuda::DeviceGuard g(devices[m]);
                              ncclCommAbort(comms[m]);
                            },
                            [this](const std::vector<int>& ms) {
                              REPLICA_NCCL_CHECK(ncclGroupStart());
                              for (int m : ms) {
                                cuda::DeviceGuard g(devices[m]);
                                REPLICA_NCCL_CHECK(ncclCommFinalize(comms[m]));
                              }
                              REPLICA_NCCL_CHECK(ncclGroupEnd());
                              for (int m : ms) {
                                cuda::DeviceGuard g(devices[m]);
                                REPLICA_NCCL_CHECK(ncclCommDestroy(comms[m]));
                              }
                            }});
  }
};

class NcclWork : public Work {
 public:
  NcclWork(ncclComm_t comm, cudaEvent_t ev, int device, std::shared_ptr<CommClique> clique, int rank,
           std::chrono::milliseconds timeout, const char* what)
      : comm_(comm), ev_(ev), device_(device), clique_(std::move(clique)), rank_(rank), timeout_(timeout),
        what_(what), t0_(std::chrono::steady_clock::now()) {}
  // The event belongs to the communicator's ring of events (not destroyed here).
  bool done() override { return cudaEventQuery(ev_) == cudaSuccess; }
  void wait() override {
    for (int spin = 0;; ++spin) {
      if (poll()) return;
      // Spin briefly (collectives of a step finish in microseconds to milliseconds), then yield.
      if (spin > 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  // The stream waits on the device: no host round trip (the step's one host wait polls check()).
  void order_before(Stream& s) override {
    clique_->check(rank_, std::string("NCCL ") + what_);
    if (!s.native()) return wait();
    cuda::DeviceGuard g(device_);
    REPLICA_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(s.native()), ev_, 0));
  }
  void check() override { poll(); }

 private:
  // True when the collective has completed; throws (after aborting the clique) on an error, an
  // abort by another replica, or the time-out counted from the collective's launch.
  bool poll() {
    cudaError_t q = cudaEventQuery(ev_);
    if (q == cudaSuccess) return true;
    const std::string what = std::string("NCCL ") + what_;
    // Another replica failed and aborted the clique: fail now, not at the time-out.
    clique_->check(rank_, what);
    if (q != cudaErrorNotReady) {
      const std::string why = what + " on rank " + std::to_string(rank_) + ": " + cudaGetErrorString(q);
      clique_->abort(why);
      throw CudaError(why);
    }
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess) {
      const std::string why = what + " failed on rank " + std::to_string(rank_) + ": " + ncclGetErrorString(async);
      clique_->abort(why);
      throw CommError(why + " (communicators aborted)");
    }
    if (std::chrono::steady_clock::now() - t0_ > timeout_) {
      char secs[32];
      std::snprintf(secs, sizeof secs, "%.1f", timeout_.count() / 1000.0);
      const std::string why = what + " on rank " + std::to_string(rank_) + " timed out after " + secs + " s";
      clique_->abort(why);
      throw CommError(why + " (communicators aborted)");
    }
    return false;
  }

  ncclComm_t comm_;
  cudaEvent_t ev_;
  int device_;
  std::shared_ptr<CommClique> clique_;
  int rank_;
  std::chrono::milliseconds timeout_;
  const char* what_;
  std::chrono::steady_clock::time_point t0_;
};

// Inside a CUDA graph capture, NCCL_LAUNCH_ORDER_IMPLICIT does not order two communicators'
// kernels on a GPU (it orders launches; a graph's independent branches have none): a gradient
// bucket forked onto one communicator's stream and sync-BN's collectives on the latency lane would
// be parallel branches, which two GPUs may start in different orders and deadlock. So while a
// replica's compute stream is captured, each collective of any of its communicators waits for the
// one issued before it (the host's issue order, the same on every rank), one chain per capture.
class CaptureChains {
 public:
  // `done` is the last collective issued for `compute` in capture `id`.
  void extend(cudaStream_t compute, unsigned long long id, cudaEvent_t done) {
    std::lock_guard<std::mutex> lock(m_);
    links_[compute] = {id, done};
  }
  // The last collective issued for `compute` in capture `id`, or null.
  cudaEvent_t last(cudaStream_t compute, unsigned long long id) {
    std::lock_guard<std::mutex> lock(m_);
    const auto it = links_.find(compute);
    return it != links_.end() && it->second.id == id ? it->second.last : nullptr;
  }

 private:
  struct Link {
    unsigned long long id = 0;
    cudaEvent_t last = nullptr;
  };
  std::mutex m_;
  std::unordered_map<cudaStream_t, Link> links_;
};
CaptureChains& capture_chains() {
  static CaptureChains chains;
  return chains;
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<NcclClique> clique, int member, int rank, int world, cudaStream_t compute,
                   NcclOptions o)
      : clique_(std::move(clique)), comm_(clique_->comms[member]), device_(clique_->devices[member]), rank_(rank),
        world_(world), compute_(compute), o_(o) {
    cuda::DeviceGuard g(device_);
    if (o.high_priority) {  // the latency lane: its small collectives go ahead of queued kernels
      int least = 0, greatest = 0;
      REPLICA_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      REPLICA_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest));
    } else {
      REPLICA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    }
    REPLICA_CUDA_CHECK(cudaMalloc(&scratch_, sizeof(float)));
    // Preallocated events: one to order the comm stream after compute, a ring for completions
    // (a collective's Work is waited on long before kEvents later ones are issued).
    REPLICA_CUDA_CHECK(cudaEventCreateWithFlags(&after_compute_, cudaEventDisableTiming));
    for (auto& e : done_) REPLICA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  ~NcclCommunicator() override {
    cuda::DeviceGuard g(device_);
    if (!clique_->state->aborted()) cudaStreamSynchronize(stream_);
    for (auto& e : done_) cudaEventDestroy(e);
    cudaEventDestroy(after_compute_);
    cudaFree(scratch_);
    cudaStreamDestroy(stream_);
    // The communicator itself is finalized and destroyed with the others of its clique.
  }
  int rank() const override { return rank_; }
  int size() const override { return world_; }
  std::string name() const override { return "nccl"; }
  bool device_buffers() const override { return true; }
  std::string cuda_graph_refusal() const override { return nccl_graph_refusal(); }
  CaptureHolds* capture_holds() override { return &clique_->state->capture_holds(); }
  // Aborts every communicator of this process's group (NCCL needs all ranks aborted); later
  // calls on any of them are CommErrors naming their rank.
  void abort(const std::string& why) override {
    clique_->state->abort(why);
    // Ranks in other processes cannot be aborted from here: end the job, naming this rank, so
    // they fail now instead of waiting out parallel.timeout_s (as the MPI communicator does).
    if (clique_->across_processes) abort_mpi_job("global rank " + std::to_string(rank_) + ": " + why);
  }

  WorkHandle all_reduce_async(void* d, size_t n, DType t, ReduceOp op) override {
    begin("all_reduce");
    REPLICA_NCCL_CHECK(ncclAllReduce(d, d, n, nccl_type(t), nccl_op(op), comm_, stream_));
    return end("all_reduce");
  }
  WorkHandle broadcast_async(void* d, size_t n, DType t, int root) override {
    if (root < 0 || root >= world_) throw CommError("broadcast: root " + std::to_string(root) + " is not a rank");
    begin("broadcast");
    REPLICA_NCCL_CHECK(ncclBroadcast(d, d, n, nccl_type(t), root, comm_, stream_));
    return end("broadcast");
  }
  WorkHandle all_gather_async(const void* s, void* r, size_t n, DType t) override {
    begin("all_gather");
    REPLICA_NCCL_CHECK(ncclAllGather(s, r, n, nccl_type(t), comm_, stream_));
    return end("all_gather");
  }
  WorkHandle reduce_scatter_async(const void* s, void* r, size_t n, DType t, ReduceOp op) override {
    begin("reduce_scatter");
    REPLICA_NCCL_CHECK(ncclReduceScatter(s, r, n, nccl_type(t), nccl_op(op), comm_, stream_));
    return end("reduce_scatter");
  }
  // Uneven ranges: one grouped launch of a reduce (or broadcast) per owner, in place. NCCL's
  // reduce may add in another order than its all-reduce ring, so on GPUs a sharded run agrees
  // with an unsharded one to within f32 rounding, not bit for bit (the host and MPI paths are exact).
  WorkHandle reduce_scatter_v_async(void* d, size_t n, DType t, ReduceOp op, const std::vector<size_t>& b) override {
    check_bounds("reduce_scatter_v", n, b);
    return per_owner("reduce_scatter_v", d, t, b, [&](char* p, size_t count, int owner) {
      REPLICA_NCCL_CHECK(ncclReduce(p, p, count, nccl_type(t), nccl_op(op), owner, comm_, stream_));
    });
  }
  WorkHandle all_gather_v_async(void* d, size_t n, DType t, const std::vector<size_t>& b) override {
    check_bounds("all_gather_v", n, b);
    return per_owner("all_gather_v", d, t, b, [&](char* p, size_t count, int owner) {
      REPLICA_NCCL_CHECK(ncclBroadcast(p, p, count, nccl_type(t), owner, comm_, stream_));
    });
  }
  // The replayed step's collectives are nodes of its graph, queued on the compute stream: an event
  // recorded there after the replay completes when they (and the step) have, and polls as theirs.
  WorkHandle stream_work(Stream& s, const char* what) override {
    clique_->state->check(rank_, std::string("NCCL ") + what);
    if (!s.native()) return std::make_shared<DoneWork>();
    cuda::DeviceGuard g(device_);
    cudaEvent_t e = done_[next_++ % kEvents];
    REPLICA_CUDA_CHECK(cudaEventRecord(e, static_cast<cudaStream_t>(s.native())));
    return std::make_shared<NcclWork>(comm_, e, device_, clique_->state, rank_, o_.timeout, what);
  }
  WorkHandle barrier_async() override {
    begin("barrier");
    REPLICA_NCCL_CHECK(ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, stream_));
    return end("barrier");
  }

 private:
  // One grouped launch of call(owner's range, its length, owner) for every rank that owns elements.
  template <typename F>
  WorkHandle per_owner(const char* what, void* d, DType t, const std::vector<size_t>& b, F call) {
    begin(what);
    const size_t es = dtype_size(t);
    REPLICA_NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < world_; ++r)
      if (b[r + 1] > b[r]) call(static_cast<char*>(d) + b[r] * es, b[r + 1] - b[r], r);
    REPLICA_NCCL_CHECK(ncclGroupEnd());
    return end(what);
  }
  // Orders the collective after the replica's compute work (data produced there): a stream wait
  // on a preallocated event, no host synchronisation.
  void begin(const char* what) {
    clique_->state->check(rank_, std::string("NCCL ") + what);
    cuda::DeviceGuard g(device_);
    capture_id_ = 0;
    if (compute_) {
      REPLICA_CUDA_CHECK(cudaEventRecord(after_compute_, compute_));
      REPLICA_CUDA_CHECK(cudaStreamWaitEvent(stream_, after_compute_, 0));
      cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
      unsigned long long id = 0;
      REPLICA_CUDA_CHECK(cudaStreamGetCaptureInfo(compute_, &cs, &id));
      if (cs == cudaStreamCaptureStatusActive) {  // after the collective issued before it (CaptureChains)
        capture_id_ = id;
        if (cudaEvent_t before = capture_chains().last(compute_, id))
          REPLICA_CUDA_CHECK(cudaStreamWaitEvent(stream_, before, 0));
      }
    }
  }
  WorkHandle end(const char* what) {
    cudaEvent_t e = done_[next_++ % kEvents];
    REPLICA_CUDA_CHECK(cudaEventRecord(e, stream_));
    if (capture_id_) capture_chains().extend(compute_, capture_id_, e);
    return std::make_shared<NcclWork>(comm_, e, device_, clique_->state, rank_, o_.timeout, what);
  }

  static constexpr int kEvents = 64;
  std::shared_ptr<NcclClique> clique_;
  ncclComm_t comm_;
  int device_, rank_, world_;
  cudaStream_t compute_, stream_ = nullptr;
  NcclOptions o_;
  float* scratch_ = nullptr;
  unsigned long long capture_id_ = 0;  // the capture the collective being issued belongs to (0: none)
  cudaEvent_t after_compute_ = nullptr;
  cudaEvent_t done_[kEvents] = {};
  uint64_t next_ = 0;
};

}  // namespace

bool nccl_orders_communicators() {
  int v = 0;
  return ncclGetVersion(&v) == ncclSuccess && v >= 22600;
}

std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(const std::vector<Device>& devices,
                                                                   const std::vector<Stream*>& streams,
                                                                   NcclOptions o) {
  const int local = static_cast<int>(devices.size());
  // Two communicators per GPU (the gradient one and the latency lane) are deadlock-free only when
  // every device launches their kernels in one order: NCCL 2.26+ takes it from the host's issue
  // order (each replica thread issues its collectives in program order, the same on every rank).
  // Set before the first communicator exists; a value the user set is kept.
  if (nccl_orders_communicators()) setenv("NCCL_LAUNCH_ORDER_IMPLICIT", "1", 0);
  std::vector<ncclComm_t> comms(local);
  int proc = 0, procs = 1;
  if (launched_by_mpi()) {
#ifdef REPLICA_WITH_MPI
    MpiProcess p = mpi_process();
    proc = p.rank;
    procs = p.size;
#else
    throw CommError("NCCL across processes needs the MPI build");
#endif
  }
  const int world = procs * local;
  if (procs == 1) {
    std::vector<int> ids(local);
    for (int i = 0; i < local; ++i) ids[i] = devices[i].index;
    REPLICA_NCCL_CHECK(ncclCommInitAll(comms.data(), local, ids.data()));
  } else {
#ifdef REPLICA_WITH_MPI
    ncclUniqueId id;
    if (proc == 0) REPLICA_NCCL_CHECK(ncclGetUniqueId(&id));
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    {
      cuda::DeviceGuard restore(devices[0].index);  // the caller's device is back afterwards
      REPLICA_NCCL_CHECK(ncclGroupStart());
      for (int i = 0; i < local; ++i) {
        REPLICA_CUDA_CHECK(cudaSetDevice(devices[i].index));
        REPLICA_NCCL_CHECK(ncclCommInitRank(&comms[i], world, id, proc * local + i));
      }
      REPLICA_NCCL_CHECK(ncclGroupEnd());
    }
#endif
  }
  std::vector<int> ids(local);
  for (int i = 0; i < local; ++i) ids[i] = devices[i].index;
  auto clique = std::make_shared<NcclClique>(comms, ids);
  clique->across_processes = procs > 1;
  std::vector<std::unique_ptr<Communicator>> out;
  for (int i = 0; i < local; ++i) {
    cudaStream_t s = i < static_cast<int>(streams.size()) && streams[i] ? static_cast<cudaStream_t>(streams[i]->native()) : nullptr;
    out.push_back(std::make_unique<NcclCommunicator>(clique, i, proc * local + i, world, s, o));
  }
  return out;
}

}  // namespace replica::parallel
