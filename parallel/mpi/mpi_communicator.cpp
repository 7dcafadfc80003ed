// MpiCommunicator: composition of the in-process host communicator and MPI calls made by each
// process's leader (local replica 0), under MPI_THREAD_SERIALIZED. When every process is on one
// machine, f32 all-reduces between leaders go through a shared window (NodeAllReduce) instead. Collectives are non-blocking
// MPI calls polled with a time-out, so a dead peer turns into an abort with a message, not a hang.
#include "parallel/mpi/mpi_communicator.h"

#include <mpi.h>
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "core/errors.h"
#include "parallel/collective_queue.h"
#include "parallel/host/host_communicator.h"
#include "parallel/mpi/node_shared_memory.h"

namespace replica::parallel {

bool mpi_compiled() { return true; }

bool mpi_has_ulfm() {
#ifdef MPIX_ERR_PROC_FAILED
  return true;
#else
  return false;
#endif
}

std::string mpi_version() {
  char v[MPI_MAX_LIBRARY_VERSION_STRING];
  int n = 0;
  MPI_Get_library_version(v, &n);  // allowed before MPI_Init (MPI 3.0)
  std::string s(v, static_cast<size_t>(n));
  if (auto nl = s.find_first_of("\n,"); nl != std::string::npos) s.resize(nl);
  return s;
}

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

// 16-bit sums across processes with the running sum rounded to the dtype after each addition:
// NCCL's semantics (communicator.h), so an MPI run reduces 16-bit wires as a GPU run does.
// A block at a time through the vectorised conversions (element by element: 0.06 GB/s).
template <DType T>
void sum16(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  constexpr size_t kBlock = 512;
  float x[kBlock], y[kBlock];
  for (size_t lo = 0, n = static_cast<size_t>(*len); lo < n; lo += kBlock) {
    const size_t m = std::min(kBlock, n - lo);
    convert(a + lo, T, x, DType::f32, m);
    convert(b + lo, T, y, DType::f32, m);
    for (size_t i = 0; i < m; ++i) y[i] += x[i];
    convert(y, DType::f32, b + lo, T, m);
  }
}
MPI_Op sum16_op(DType t) {
  static MPI_Op f16 = MPI_OP_NULL, bf16 = MPI_OP_NULL;
  static std::once_flag once;
  std::call_once(once, [] {
    MPI_Op_create(&sum16<DType::f16>, 1, &f16);
    MPI_Op_create(&sum16<DType::bf16>, 1, &bf16);
  });
  return t == DType::f16 ? f16 : bf16;
}

// Arrival tracking between process leaders: before collective #k, a leader sends k to every
// peer; it keeps one receive posted per peer and records the highest k each peer reached. When a
// collective times out, the peers whose last k is below ours are the ones that never arrived
// (stopped, dead, or stuck in other work), and the error names them.
class Arrivals {
 public:
  explicit Arrivals(MpiProcess proc) : proc_(proc), seen_(proc.size, 0), buf_(proc.size, 0), recv_(proc.size) {
    MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
    for (int p = 0; p < proc_.size; ++p)
      if (p != proc_.rank) post(p);
  }
  ~Arrivals() {
    for (int p = 0; p < proc_.size; ++p) {
      if (p == proc_.rank) continue;
      MPI_Cancel(&recv_[p]);
      MPI_Wait(&recv_[p], MPI_STATUS_IGNORE);
    }
    reap(true);
    MPI_Comm_free(&comm_);
  }
  // Announces that this process reached collective number `k`.
  void arrive(long long k) {
    reap(false);
    for (int p = 0; p < proc_.size; ++p) {
      if (p == proc_.rank) continue;
      sends_.push_back({k, MPI_REQUEST_NULL});
      MPI_Isend(&sends_.back().value, 1, MPI_LONG_LONG, p, kTag, comm_, &sends_.back().req);
    }
  }
  void poll() {
    for (int p = 0; p < proc_.size; ++p) {
      if (p == proc_.rank) continue;
      for (int done = 1; done;) {
        MPI_Test(&recv_[p], &done, MPI_STATUS_IGNORE);
        if (done) {
          seen_[p] = std::max(seen_[p], buf_[p]);
          post(p);
        }
      }
    }
  }
  // "process 1 (global ranks 2-3) last reached collective #41" for every peer behind `k`.
  std::string missing(long long k, int local_count) {
    poll();
    std::string out;
    for (int p = 0; p < proc_.size; ++p) {
      if (p == proc_.rank || seen_[p] >= k) continue;
      const int lo = p * local_count, hi = lo + local_count - 1;
      out += std::string(out.empty() ? "" : "; ") + "process " + std::to_string(p) + " (global rank" +
             (lo == hi ? " " + std::to_string(lo) : "s " + std::to_string(lo) + "-" + std::to_string(hi)) +
             ") never reached it (its last was collective #" + std::to_string(seen_[p]) + ")";
    }
    return out;
  }

 private:
  static constexpr int kTag = 7301;
  struct Send {
    long long value;
    MPI_Request req;
  };
  void post(int p) { MPI_Irecv(&buf_[p], 1, MPI_LONG_LONG, p, kTag, comm_, &recv_[p]); }
  void reap(bool all) {  // completed sends are dropped; at the end, unfinished ones are freed
    while (!sends_.empty()) {
      int done = 0;
      MPI_Test(&sends_.front().req, &done, MPI_STATUS_IGNORE);
      if (!done) {
        if (!all) return;
        MPI_Request_free(&sends_.front().req);
      }
      sends_.pop_front();
    }
  }
  MpiProcess proc_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  std::vector<long long> seen_, buf_;
  std::vector<MPI_Request> recv_;
  std::deque<Send> sends_;  // a deque: elements stay where they are while MPI reads them
};

class MpiCommunicator : public Communicator {
 public:
  MpiCommunicator(std::unique_ptr<Communicator> local, int local_index, int local_count, MpiProcess proc,
                  MpiCommOptions o)
      : local_(std::move(local)), li_(local_index), lc_(local_count), proc_(proc), o_(o) {
    if (li_ == 0 && proc_.size > 1) {
      arrivals_ = std::make_unique<Arrivals>(proc_);
      node_ = NodeAllReduce::create(MPI_COMM_WORLD, o_.timeout, lc_);
    }
  }

  int rank() const override { return proc_.rank * lc_ + li_; }
  int size() const override { return proc_.size * lc_; }
  std::string name() const override { return "mpi"; }
  bool maps_peer_buffers() const override { return node_ != nullptr; }
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
  // The uneven forms are the defaults (communicator.h): a whole all-reduce or a padded all-gather,
  // so a sharded run reduces with exactly the bits of the hierarchical all-reduce above.
  WorkHandle reduce_scatter_v_async(void* d, size_t n, DType t, ReduceOp op, const std::vector<size_t>& b) override {
    check_bounds("reduce_scatter_v", n, b);
    return queue_.submit([=, this] { reduce_scatter_v_by_all_reduce(d, n, t, op, b); });
  }
  WorkHandle all_gather_v_async(void* d, size_t n, DType t, const std::vector<size_t>& b) override {
    check_bounds("all_gather_v", n, b);
    return queue_.submit([=, this] { all_gather_v_by_all_gather(d, n, t, b); });
  }
  void reduce_scatter_v(void* d, size_t n, DType t, ReduceOp op, const std::vector<size_t>& b) override {
    reduce_scatter_v_by_all_reduce(d, n, t, op, b);
  }
  void all_gather_v(void* d, size_t n, DType t, const std::vector<size_t>& b) override {
    all_gather_v_by_all_gather(d, n, t, b);
  }

  // Blocking forms run here, after the async ones issued before them (the same order on every
  // rank, as the Communicator contract asks).
  void all_reduce(void* d, size_t n, DType t, ReduceOp op) override {
    serial([&] {
      if (t == DType::i32 || t == DType::u8) throw CommError("all_reduce: integer dtypes are not reducible");
      if ((t == DType::f16 || t == DType::bf16) && op != ReduceOp::max) return all_reduce16(d, n, t, op);
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
        start();
        if (node_) {
          on_node([&] {
            node_->all_reduce(p, n, max, node_collective());
            return true;
          });
        } else {
          MPI_Request req;
          MPI_Iallreduce(MPI_IN_PLACE, p, static_cast<int>(n), mpi_float(), max ? MPI_MAX : MPI_SUM, MPI_COMM_WORLD,
                         &req);
          wait(req, "all_reduce");
        }
      }
      local_->broadcast(p, n, DType::f32, 0);
      if (op == ReduceOp::avg)
        for (size_t i = 0; i < n; ++i) p[i] /= static_cast<float>(size());
      if (t != DType::f32) convert(p, DType::f32, d, t, n);
    });
  }
  // 16-bit sum / avg: avg pre-multiplies every contribution by 1/size() (rounded, as ncclAvg),
  // then a 16-bit sum in rank order inside the process and a 16-bit sum across processes.
  void all_reduce16(void* d, size_t n, DType t, ReduceOp op) {
    auto* h = static_cast<uint16_t*>(d);
    if (op == ReduceOp::avg) {  // a block at a time through the vectorised conversions
      const float pre = 1.f / static_cast<float>(size());
      constexpr size_t kBlock = 512;
      float v[kBlock];
      for (size_t lo = 0; lo < n; lo += kBlock) {
        const size_t m = std::min(kBlock, n - lo);
        convert(h + lo, t, v, DType::f32, m);
        for (size_t i = 0; i < m; ++i) v[i] *= pre;
        convert(v, DType::f32, h + lo, t, m);
      }
    }
    local_->all_reduce(d, n, t, ReduceOp::sum);
    if (li_ == 0 && proc_.size > 1) {
      start();
      // In place when every leader's buffer is in shared pool memory, else MPI's operator.
      if (!node_ || !on_node([&] { return node_->all_reduce16(d, n, t, node_collective()); })) {
        MPI_Request req;
        MPI_Iallreduce(MPI_IN_PLACE, d, static_cast<int>(n), MPI_UINT16_T, sum16_op(t), MPI_COMM_WORLD, &req);
        wait(req, "all_reduce");
      }
    }
    local_->broadcast(d, n, t, 0);
  }

  void broadcast(void* d, size_t n, DType t, int root) override {
    serial([&] {
      if (root < 0 || root >= size()) throw CommError("broadcast: root " + std::to_string(root) + " is not a rank");
      const int root_proc = root / lc_, root_local = root % lc_;
      if (proc_.rank == root_proc) local_->broadcast(d, n, t, root_local);
      if (li_ == 0 && proc_.size > 1) {
        MPI_Request req;
        start();
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
        start();
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
        start();
        MPI_Ibarrier(MPI_COMM_WORLD, &req);
        wait(req, "barrier");
      }
      local_->barrier();
    });
  }

 private:
  // Called by the leader right before it starts an MPI collective.
  void start() {
    ++seq_;
    if (arrivals_) arrivals_->arrive(seq_);
  }
  // Runs a node all-reduce: its CommError (a process timed out at a barrier) takes the whole job
  // down, as a time-out in an MPI call does.
  template <typename F>
  bool on_node(F&& f) {
    try {
      return f();
    } catch (const CommError& e) {
      abort_mpi_job("global rank " + std::to_string(rank()) + ": " + e.what(), kExitRestartable);
      throw;  // abort_mpi_job does not return once MPI is up
    }
  }
  std::string node_collective() const { return "all_reduce (collective #" + std::to_string(seq_) + ")"; }
  void wait(MPI_Request& req, const char* what) {
    const auto t0 = std::chrono::steady_clock::now();
    int done = 0;
    for (int spin = 0;; ++spin) {
      MPI_Test(&req, &done, MPI_STATUS_IGNORE);
      if (done) return;
      if ((spin & 255) == 0 && arrivals_) arrivals_->poll();
      if (std::chrono::steady_clock::now() - t0 > o_.timeout) {
        std::string who = arrivals_ ? arrivals_->missing(seq_, lc_) : std::string();
        char secs[32];
        std::snprintf(secs, sizeof secs, "%.1f", o_.timeout.count() / 1000.0);
        abort_mpi_job("global rank " + std::to_string(rank()) + " timed out after " + secs + " s in " + what +
                      " (collective #" + std::to_string(seq_) + ") waiting for another process: " +
                      (who.empty() ? std::string("every process arrived, so one is stuck inside it or issuing other "
                                                 "collectives")
                                   : who + " (stopped, dead, or stuck in other work)"),
                      kExitRestartable);
      }
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
  long long seq_ = 0;                  // MPI collectives this leader has started
  std::unique_ptr<Arrivals> arrivals_;  // leaders of multi-process jobs only
  std::unique_ptr<NodeAllReduce> node_;  // leaders of a job whose processes share one machine
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
