// MpiCommunicator: composition of the in-process host communicator and MPI calls made by each
// process's leader (local replica 0), under MPI_THREAD_SERIALIZED. Collectives are non-blocking
// MPI calls polled with a time-out, so a dead peer turns into an abort with a message, not a hang.
#include "parallel/mpi/mpi_communicator.h"

#include <mpi.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "core/errors.h"
#include "parallel/collective_queue.h"
#include "parallel/host/host_communicator.h"

namespace replica::parallel {

bool mpi_compiled() { return true; }

bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK");
}

namespace {
std::once_flag g_init;
MpiProcess g_proc;

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}
}  // namespace

MpiProcess mpi_process() {
  std::call_once(g_init, [] {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    if (provided < MPI_THREAD_SERIALIZED)
      throw CommError("MPI: the library provides thread level " + std::to_string(provided) +
                      "; replica needs MPI_THREAD_SERIALIZED");
    MPI_Comm_rank(MPI_COMM_WORLD, &g_proc.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_proc.size);
    std::atexit(finalize_at_exit);
  });
  return g_proc;
}

void abort_mpi_job(const std::string& why, int code) {
  int init = 0;
  MPI_Initialized(&init);
  if (!init) return;
  std::fprintf(stderr, "replica: process %d: %s; aborting the MPI job\n", g_proc.rank, why.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code);
}

namespace {

MPI_Datatype mpi_float() { return MPI_FLOAT; }

class MpiCommunicator : public Communicator {
 public:
  MpiCommunicator(std::unique_ptr<Communicator> local, int local_index, int local_count, MpiProcess proc,
                  MpiCommOptions o)
      : local_(std::move(local)), li_(local_index), lc_(local_count), proc_(proc), o_(o) {}

  int rank() const override { return proc_.rank * lc_ + li_; }
  int size() const override { return proc_.size * lc_; }
  std::string name() const override { return "mpi"; }
  void abort(const std::string& why) override {
    local_->abort(why);
    abort_mpi_job("global rank " + std::to_string(rank()) + ": " + why);
  }

  WorkHandle all_reduce_async(void* d, size_t n, DType t, ReduceOp op) override {
    return queue_.submit([=, this] { all_reduce(d, n, t, op); });
  }
  WorkHandle broadcast_async(void* d, size_t n, DType t, int root) override {
    return queue_.submit([=, this] { broadcast(d, n, t, root); });
  }
  WorkHandle all_gather_async(const void* s, void* r, size_t n, DType t) override {
    return queue_.submit([=, this] { all_gather(s, r, n, t); });
  }
  WorkHandle reduce_scatter_async(const void* s, void* r, size_t n, DType t, ReduceOp op) override {
    return queue_.submit([=, this] { reduce_scatter(s, r, n, t, op); });
  }
  WorkHandle barrier_async() override {
    return queue_.submit([this] { barrier(); });
  }

  // Blocking forms run here, after the async ones issued before them (the same order on every
  // rank, as the Communicator contract asks).
  void all_reduce(void* d, size_t n, DType t, ReduceOp op) override {
    serial([&] {
      if (t == DType::i32 || t == DType::u8) throw CommError("all_reduce: integer dtypes are not reducible");
      std::vector<float> staging;
      float* p = static_cast<float*>(d);
      if (t != DType::f32) {
        staging.resize(n);
        convert(d, t, staging.data(), DType::f32, n);
        p = staging.data();
      }
      const bool max = op == ReduceOp::max;
      local_->all_reduce(p, n, DType::f32, max ? ReduceOp::max : ReduceOp::sum);
      if (li_ == 0 && proc_.size > 1) {
        MPI_Request req;
        MPI_Iallreduce(MPI_IN_PLACE, p, static_cast<int>(n), mpi_float(), max ? MPI_MAX : MPI_SUM, MPI_COMM_WORLD, &req);
        wait(req, "all_reduce");
      }
      local_->broadcast(p, n, DType::f32, 0);
      if (op == ReduceOp::avg)
        for (size_t i = 0; i < n; ++i) p[i] /= static_cast<float>(size());
      if (t != DType::f32) convert(p, DType::f32, d, t, n);
    });
  }
  void broadcast(void* d, size_t n, DType t, int root) override {
    serial([&] {
      if (root < 0 || root >= size()) throw CommError("broadcast: root " + std::to_string(root) + " is not a rank");
      const int root_proc = root / lc_, root_local = root % lc_;
      if (proc_.rank == root_proc) local_->broadcast(d, n, t, root_local);
      if (li_ == 0 && proc_.size > 1) {
        MPI_Request req;
        MPI_Ibcast(d, static_cast<int>(n * dtype_size(t)), MPI_BYTE, root_proc, MPI_COMM_WORLD, &req);
        wait(req, "broadcast");
      }
      local_->broadcast(d, n, t, 0);
    });
  }
  void all_gather(const void* s, void* r, size_t n, DType t) override {
    serial([&] {
      const size_t block = n * dtype_size(t) * lc_;
      char* mine = static_cast<char*>(r) + proc_.rank * block;
      local_->all_gather(s, mine, n, t);
      if (li_ == 0 && proc_.size > 1) {
        MPI_Request req;
        MPI_Iallgather(MPI_IN_PLACE, 0, MPI_BYTE, r, static_cast<int>(block), MPI_BYTE, MPI_COMM_WORLD, &req);
        wait(req, "all_gather");
      }
      local_->broadcast(r, n * size(), t, 0);
    });
  }
  void reduce_scatter(const void* s, void* r, size_t n, DType t, ReduceOp op) override {
    // An all-reduce of the whole buffer, then this rank's block: simple, 2x the bytes of a
    // true reduce-scatter (GradientSync does not use it).
    std::vector<char> tmp(static_cast<const char*>(s), static_cast<const char*>(s) + n * size() * dtype_size(t));
    all_reduce(tmp.data(), n * size(), t, op);
    std::memcpy(r, tmp.data() + rank() * n * dtype_size(t), n * dtype_size(t));
  }
  void barrier() override {
    serial([&] {
      local_->barrier();
      if (li_ == 0 && proc_.size > 1) {
        MPI_Request req;
        MPI_Ibarrier(MPI_COMM_WORLD, &req);
        wait(req, "barrier");
      }
      local_->barrier();
    });
  }

 private:
  void wait(MPI_Request& req, const char* what) {
    const auto t0 = std::chrono::steady_clock::now();
    int done = 0;
    for (;;) {
      MPI_Test(&req, &done, MPI_STATUS_IGNORE);
      if (done) return;
      if (std::chrono::steady_clock::now() - t0 > o_.timeout)
        abort_mpi_job("global rank " + std::to_string(rank()) + " timed out after " +
                      std::to_string(o_.timeout.count() / 1000.0) + " s in " + what +
                      " waiting for another process (dead, stuck, or issuing other collectives)");
      std::this_thread::yield();
    }
  }

  template <typename F>
  void serial(F&& f) {
    queue_.run_here(std::forward<F>(f));
  }

  std::unique_ptr<Communicator> local_;
  int li_, lc_;
  MpiProcess proc_;
  MpiCommOptions o_;
  CollectiveQueue queue_;  // last: its worker may run collectives that use the members above
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_mpi_communicators(int local, MpiCommOptions opts) {
  MpiProcess proc = mpi_process();
  HostCommOptions ho;
  ho.timeout = opts.timeout;
  auto locals = make_host_communicators(local, ho);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int i = 0; i < local; ++i)
    out.push_back(std::make_unique<MpiCommunicator>(std::move(locals[i]), i, local, proc, opts));
  return out;
}

}  // namespace replica::parallel
