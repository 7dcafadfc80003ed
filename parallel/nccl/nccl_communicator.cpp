// NcclCommunicator implementation (built when CUDA is).
#include "parallel/nccl/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <string>
#include <thread>

#include "core/cuda/check.h"
#include "core/errors.h"
#include "parallel/mpi/mpi_communicator.h"

#ifdef REPLICA_WITH_MPI
#include <mpi.h>
#endif

namespace replica::parallel {

bool nccl_compiled() { return true; }

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

class NcclWork : public Work {
 public:
  NcclWork(ncclComm_t comm, cudaEvent_t ev, int rank, std::chrono::milliseconds timeout, const char* what)
      : comm_(comm), ev_(ev), rank_(rank), timeout_(timeout), what_(what) {}
  ~NcclWork() override { cudaEventDestroy(ev_); }
  bool done() override { return cudaEventQuery(ev_) == cudaSuccess; }
  void wait() override {
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      cudaError_t q = cudaEventQuery(ev_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) throw CudaError(std::string("NCCL ") + what_ + " on rank " + std::to_string(rank_) + ": " + cudaGetErrorString(q));
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess) {
        ncclCommAbort(comm_);
        throw CommError("NCCL " + std::string(what_) + " failed on rank " + std::to_string(rank_) + ": " +
                        ncclGetErrorString(async) + " (communicator aborted)");
      }
      if (std::chrono::steady_clock::now() - t0 > timeout_) {
        ncclCommAbort(comm_);
        throw CommError("NCCL " + std::string(what_) + " on rank " + std::to_string(rank_) + " timed out after " +
                        std::to_string(timeout_.count() / 1000.0) + " s (communicator aborted)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

 private:
  ncclComm_t comm_;
  cudaEvent_t ev_;
  int rank_;
  std::chrono::milliseconds timeout_;
  const char* what_;
};

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int device, int rank, int world, cudaStream_t compute, NcclOptions o)
      : comm_(comm), device_(device), rank_(rank), world_(world), compute_(compute), o_(o) {
    REPLICA_CUDA_CHECK(cudaSetDevice(device_));
    REPLICA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    REPLICA_CUDA_CHECK(cudaMalloc(&scratch_, sizeof(float)));
  }
  ~NcclCommunicator() override {
    cudaSetDevice(device_);
    cudaFree(scratch_);
    cudaStreamDestroy(stream_);
    if (!aborted_) ncclCommDestroy(comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return world_; }
  std::string name() const override { return "nccl"; }
  bool device_buffers() const override { return true; }
  void abort(const std::string&) override {
    if (!aborted_) ncclCommAbort(comm_);
    aborted_ = true;
  }

  WorkHandle all_reduce_async(void* d, size_t n, DType t, ReduceOp op) override {
    begin();
    REPLICA_NCCL_CHECK(ncclAllReduce(d, d, n, nccl_type(t), nccl_op(op), comm_, stream_));
    return end("all_reduce");
  }
  WorkHandle broadcast_async(void* d, size_t n, DType t, int root) override {
    if (root < 0 || root >= world_) throw CommError("broadcast: root " + std::to_string(root) + " is not a rank");
    begin();
    REPLICA_NCCL_CHECK(ncclBroadcast(d, d, n, nccl_type(t), root, comm_, stream_));
    return end("broadcast");
  }
  WorkHandle all_gather_async(const void* s, void* r, size_t n, DType t) override {
    begin();
    REPLICA_NCCL_CHECK(ncclAllGather(s, r, n, nccl_type(t), comm_, stream_));
    return end("all_gather");
  }
  WorkHandle reduce_scatter_async(const void* s, void* r, size_t n, DType t, ReduceOp op) override {
    begin();
    REPLICA_NCCL_CHECK(ncclReduceScatter(s, r, n, nccl_type(t), nccl_op(op), comm_, stream_));
    return end("reduce_scatter");
  }
  WorkHandle barrier_async() override {
    begin();
    REPLICA_NCCL_CHECK(ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, stream_));
    return end("barrier");
  }

 private:
  // Orders the collective after the replica's compute work (data produced there).
  void begin() {
    if (aborted_) throw CommError("NCCL communicator of rank " + std::to_string(rank_) + " was aborted");
    REPLICA_CUDA_CHECK(cudaSetDevice(device_));
    if (compute_) {
      cudaEvent_t e;
      REPLICA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      REPLICA_CUDA_CHECK(cudaEventRecord(e, compute_));
      REPLICA_CUDA_CHECK(cudaStreamWaitEvent(stream_, e, 0));
      cudaEventDestroy(e);
    }
  }
  WorkHandle end(const char* what) {
    cudaEvent_t e;
    REPLICA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    REPLICA_CUDA_CHECK(cudaEventRecord(e, stream_));
    return std::make_shared<NcclWork>(comm_, e, rank_, o_.timeout, what);
  }

  ncclComm_t comm_;
  int device_, rank_, world_;
  cudaStream_t compute_, stream_ = nullptr;
  NcclOptions o_;
  float* scratch_ = nullptr;
  bool aborted_ = false;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(const std::vector<Device>& devices,
                                                                   const std::vector<Stream*>& streams,
                                                                   NcclOptions o) {
  const int local = static_cast<int>(devices.size());
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
    REPLICA_NCCL_CHECK(ncclGroupStart());
    for (int i = 0; i < local; ++i) {
      REPLICA_CUDA_CHECK(cudaSetDevice(devices[i].index));
      REPLICA_NCCL_CHECK(ncclCommInitRank(&comms[i], world, id, proc * local + i));
    }
    REPLICA_NCCL_CHECK(ncclGroupEnd());
#endif
  }
  std::vector<std::unique_ptr<Communicator>> out;
  for (int i = 0; i < local; ++i) {
    cudaStream_t s = i < static_cast<int>(streams.size()) && streams[i] ? static_cast<cudaStream_t>(streams[i]->native()) : nullptr;
    out.push_back(std::make_unique<NcclCommunicator>(comms[i], devices[i].index, proc * local + i, world, s, o));
  }
  return out;
}

}  // namespace replica::parallel
