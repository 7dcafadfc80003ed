// HostCommunicator implementation: a shared rendezvous (slots + an abortable barrier with a
// time-out) and one worker thread per rank.
#include "parallel/host/host_communicator.h"

#include "parallel/capture_holds.h"
#include "parallel/collective_queue.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "core/errors.h"
#include "parallel/accumulate.h"

namespace replica::parallel {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
  }
  return "?";
}

namespace {

enum class Kind { all_reduce, broadcast, all_gather, reduce_scatter, barrier, reduce_scatter_v, all_gather_v };
const char* kind_name(Kind k) {
  static const char* n[] = {"all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier",
                            "reduce_scatter_v", "all_gather_v"};
  return n[static_cast<int>(k)];
}

struct Slot {
  Kind kind = Kind::barrier;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  DType dtype = DType::f32;
  ReduceOp op = ReduceOp::sum;
  int root = 0;
  std::vector<size_t> bounds;  // the _v forms: rank r owns [bounds[r], bounds[r + 1])
};

}  // namespace

class HostCommState {
 public:
  HostCommState(int world, HostCommOptions o)
      : world_(world), opts_(o), slots_(world), arrived_gen_(world, 0) {}

  int world() const { return world_; }
  Slot& slot(int r) { return slots_[r]; }

  // All ranks meet; throws CommError on abort or time-out (and then aborts everyone). Waiters
  // spin for a few microseconds first: replicas in lock-step arrive close together, and a
  // condition-variable sleep and wake costs tens of microseconds.
  void barrier(int rank, const char* what) {
    std::unique_lock<std::mutex> lock(m_);
    if (aborted_) throw CommError(why_);
    const uint64_t g = gen_;
    arrived_gen_[rank] = g + 1;
    if (++arrived_ == world_) {
      arrived_ = 0;
      // Every rank is inside a barrier now, so none is claiming blocks of a collective: the
      // next collective's claims start from 0 (the release below publishes the reset).
      next_claim_.store(0, std::memory_order_relaxed);
      gen_atomic_.store(g + 1, std::memory_order_release);
      gen_++;
      cv_.notify_all();
      return;
    }
    lock.unlock();
    const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
    while (gen_atomic_.load(std::memory_order_acquire) == g && std::chrono::steady_clock::now() < spin_until)
      std::this_thread::yield();
    lock.lock();
    bool ok = cv_.wait_for(lock, opts_.timeout, [&] { return gen_ != g || aborted_; });
    // A barrier every rank reached has succeeded, even when an abort came in before this waiter
    // woke: a rank that left it may have gone on (finished its step) and failed afterwards, and
    // the survivors must agree on what completed (train/recovery.h). The next collective fails.
    if (gen_ != g) return;
    if (aborted_) throw CommError(why_);
    if (!ok) {
      std::string missing;
      for (int r = 0; r < world_; ++r)
        if (arrived_gen_[r] < g + 1) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      aborted_ = true;
      why_ = std::string("host communicator: rank ") + std::to_string(rank) + " timed out after " +
             std::to_string(opts_.timeout.count() / 1000.0) + " s in " + what +
             " waiting for rank(s) " + missing + " (a replica is stuck or issued other collectives)";
      cv_.notify_all();
      throw CommError(why_);
    }
  }

  // The next unclaimed unit of work of the running collective (reset at every barrier).
  size_t claim() { return next_claim_.fetch_add(1, std::memory_order_relaxed); }

  void abort(const std::string& why) {
    holds_.release_all();  // the recorded steps that hold the group's collectives go first
    std::lock_guard<std::mutex> lock(m_);
    if (!aborted_) {
      aborted_ = true;
      why_ = why;
    }
    cv_.notify_all();
  }
  bool aborted() {
    std::lock_guard<std::mutex> lock(m_);
    return aborted_;
  }
  std::string why() {
    std::lock_guard<std::mutex> lock(m_);
    return why_;
  }
  CaptureHolds& holds() { return holds_; }

 private:
  CaptureHolds holds_;
  int world_;
  HostCommOptions opts_;
  std::vector<Slot> slots_;
  std::mutex m_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t gen_ = 0;
  std::atomic<uint64_t> gen_atomic_{0};
  std::vector<uint64_t> arrived_gen_;
  alignas(64) std::atomic<size_t> next_claim_{0};  // its own cache line: the ranks bump it
  bool aborted_ = false;
  std::string why_;
};

namespace {

class HostCommunicator : public Communicator {
 public:
  HostCommunicator(std::shared_ptr<HostCommState> state, int rank) : state_(std::move(state)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return state_->world(); }
  std::string name() const override { return "host"; }

  WorkHandle all_reduce_async(void* data, size_t count, DType dtype, ReduceOp op) override {
    return submit({Kind::all_reduce, data, data, count, dtype, op, 0});
  }
  WorkHandle broadcast_async(void* data, size_t count, DType dtype, int root) override {
    if (root < 0 || root >= size()) throw CommError("broadcast: root " + std::to_string(root) + " is not a rank");
    return submit({Kind::broadcast, data, data, count, dtype, ReduceOp::sum, root});
  }
  WorkHandle all_gather_async(const void* send, void* recv, size_t count, DType dtype) override {
    return submit({Kind::all_gather, send, recv, count, dtype, ReduceOp::sum, 0});
  }
  WorkHandle reduce_scatter_async(const void* send, void* recv, size_t count, DType dtype,
                                  ReduceOp op) override {
    return submit({Kind::reduce_scatter, send, recv, count, dtype, op, 0});
  }
  WorkHandle barrier_async() override { return submit({Kind::barrier}); }
  WorkHandle reduce_scatter_v_async(void* data, size_t count, DType dtype, ReduceOp op,
                                    const std::vector<size_t>& bounds) override {
    check_bounds("reduce_scatter_v", count, bounds);
    return submit({Kind::reduce_scatter_v, data, data, count, dtype, op, 0, bounds});
  }
  WorkHandle all_gather_v_async(void* data, size_t count, DType dtype, const std::vector<size_t>& bounds) override {
    check_bounds("all_gather_v", count, bounds);
    return submit({Kind::all_gather_v, data, data, count, dtype, ReduceOp::sum, 0, bounds});
  }
  void reduce_scatter_v(void* data, size_t count, DType dtype, ReduceOp op, const std::vector<size_t>& bounds) override {
    check_bounds("reduce_scatter_v", count, bounds);
    run_here({Kind::reduce_scatter_v, data, data, count, dtype, op, 0, bounds});
  }
  void all_gather_v(void* data, size_t count, DType dtype, const std::vector<size_t>& bounds) override {
    check_bounds("all_gather_v", count, bounds);
    run_here({Kind::all_gather_v, data, data, count, dtype, ReduceOp::sum, 0, bounds});
  }
  void abort(const std::string& why) override { state_->abort(why); }
  CaptureHolds* capture_holds() override { return &state_->holds(); }

  void all_reduce(void* data, size_t count, DType dtype, ReduceOp op) override {
    run_here({Kind::all_reduce, data, data, count, dtype, op, 0});
  }
  void broadcast(void* data, size_t count, DType dtype, int root) override {
    if (root < 0 || root >= size()) throw CommError("broadcast: root " + std::to_string(root) + " is not a rank");
    run_here({Kind::broadcast, data, data, count, dtype, ReduceOp::sum, root});
  }
  void all_gather(const void* send, void* recv, size_t count, DType dtype) override {
    run_here({Kind::all_gather, send, recv, count, dtype, ReduceOp::sum, 0});
  }
  void reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override {
    run_here({Kind::reduce_scatter, send, recv, count, dtype, op, 0});
  }
  void barrier() override { run_here({Kind::barrier}); }

 private:
  WorkHandle submit(Slot s) {
    return queue_.submit([this, s] { run(s); });
  }
  void run_here(const Slot& s) {
    queue_.run_here([&] { run(s); });
  }

  // Every rank checks every slot against rank 0's, so all of them reach the same verdict after
  // the opening barrier and none touches another rank's buffer when one rank issued something
  // else (that rank may already have thrown and freed it).
  void check_match() {
    const Slot& r0 = state_->slot(0);
    for (int r = 1; r < size(); ++r) {
      const Slot& other = state_->slot(r);
      if (r0.kind == other.kind && r0.count == other.count && r0.dtype == other.dtype && r0.op == other.op &&
          r0.root == other.root && r0.bounds == other.bounds)
        continue;
      std::string msg = "host communicator: rank " + std::to_string(r) + " issued " + kind_name(other.kind) + "(" +
                        std::to_string(other.count) + " x " + dtype_name(other.dtype) + ") while rank 0 issued " +
                        kind_name(r0.kind) + "(" + std::to_string(r0.count) + " x " + dtype_name(r0.dtype) +
                        (r0.bounds != other.bounds ? ", with other bounds" : "") +
                        "): collectives must be issued in the same order on every rank";
      state_->abort(msg);
      throw CommError(msg);
    }
  }

  void reduce_range(ReduceOp op, DType dt, size_t lo, size_t hi, const std::vector<const void*>& srcs,
                    float* out) {
    const int R = size();
    const size_t n = hi - lo;
    if (dt == DType::f32) {
      const float* s0 = static_cast<const float*>(srcs[0]) + lo;
      std::memcpy(out, s0, n * sizeof(float));
      for (int r = 1; r < R; ++r) accumulate(out, static_cast<const float*>(srcs[r]) + lo, n, op == ReduceOp::max);
      if (op == ReduceOp::avg) {
        if ((R & (R - 1)) == 0) {  // 1/R is exact: the same bits as the division, and vectorised
          const float inv = 1.f / static_cast<float>(R);
          for (size_t i = 0; i < n; ++i) out[i] *= inv;
        } else {
          for (size_t i = 0; i < n; ++i) out[i] /= static_cast<float>(R);
        }
      }
    } else {
      // 16 bits on the wire are 16-bit arithmetic, as NCCL's ring does it: avg multiplies each
      // contribution by 1/R first (NCCL's ncclAvg), and the running sum is rounded to the wire
      // dtype after every addition, here in rank order (communicator.h, "16-bit reductions").
      // A block at a time through the vectorised conversions (element by element this ran at
      // 0.2-0.3 GB/s, bench/RESULTS.md).
      const float pre = op == ReduceOp::avg ? 1.f / static_cast<float>(R) : 1.f;
      constexpr size_t kTerm = 512;
      float term[kTerm];
      for (size_t b = 0; b < n; b += kTerm) {
        const size_t m = std::min(kTerm, n - b);
        float* o = out + b;
        auto load = [&](int r, float* dst) {  // rank r's term: its value (avg: x 1/R, rounded)
          convert(static_cast<const uint16_t*>(srcs[r]) + lo + b, dt, dst, DType::f32, m);
          if (pre == 1.f) return;
          for (size_t i = 0; i < m; ++i) dst[i] *= pre;
          round_to(dst, m, dt);
        };
        load(0, o);
        for (int r = 1; r < R; ++r) {
          load(r, term);
          accumulate(o, term, m, op == ReduceOp::max);
          if (op != ReduceOp::max) round_to(o, m, dt);
        }
      }
    }
  }

  // An all-reduce's work: every unit of the message reduced by whichever rank claims it. A
  // reduce_scatter_v writes each element into its owner's output only (s.bounds), with the same
  // fold, so its bits are the all-reduce's.
  void reduce_claimed_units(const Slot& s, const std::vector<const void*>& srcs) {
    const int R = size();
    const size_t esz = dtype_size(s.dtype);
    // The message is cut into units of kUnit elements that ranks claim from a shared counter
    // until none is left; a unit's claimer reads that range of every rank's input, reduces it
    // (f32 sums in registers, the rest a block at a time in L1; rank order, so the bits do not
    // depend on who claimed it) and writes it into that range of every rank's output. A range is
    // touched by its claimer alone, so an in-place all-reduce is safe, and all ranks
    // together move about the bytes of one memcpy of the message per rank (the first
    // version reduced into a scratch slice and then had every rank copy every slice: three
    // times the traffic, bench/RESULTS.md). Claiming instead of a fixed slice per rank
    // means the ranks that are running do the work: with more ranks than cores, a rank
    // the OS has descheduled no longer holds everyone up at the closing barrier with its
    // slice still undone. Units are whole cache lines of any buffer aligned to 64 bytes.
    constexpr size_t kUnit = 16384;  // 64 KiB of f32
    const size_t units = (s.count + kUnit - 1) / kUnit;
    std::vector<void*> outs(R);
    for (int r = 0; r < R; ++r) outs[r] = state_->slot(r).recv;
    // 2 KiB of f32 partial sums: a block's partials, its R inputs and R outputs stay in L1
    // (2048 floats, 40 KiB for 2 ranks, did not: 8 MiB median 8.3 -> 13.6 GB/s, bench/RESULTS.md).
    constexpr size_t kBlock = 512;
    float acc[kBlock];
    // f32 sums and averages in one pass, the partial sums in registers (sum_to_all), through
    // f32 views of the same pointers.
    const bool one_pass = s.dtype == DType::f32 && s.op != ReduceOp::max;
    std::vector<const float*> ins;
    std::vector<float*> outs32;
    for (int r = 0; one_pass && r < R; ++r) {
      ins.push_back(static_cast<const float*>(srcs[r]));
      outs32.push_back(static_cast<float*>(outs[r]));
    }
    const bool owners_only = s.kind == Kind::reduce_scatter_v;
    for (size_t u = state_->claim(); u < units; u = state_->claim()) {
      const size_t lo = u * kUnit, hi = std::min(s.count, lo + kUnit);
      if (owners_only) {
        for (int r = 0; r < R; ++r) {  // the unit's pieces, each into its owner's buffer alone
          const size_t a = std::max(lo, s.bounds[r]), e = std::min(hi, s.bounds[r + 1]);
          if (a >= e) continue;
          if (one_pass) {
            sum_to_all(ins.data(), &outs32[r], R, a, e - a, s.op == ReduceOp::avg, 1);
            continue;
          }
          for (size_t b = a; b < e; b += kBlock) {
            const size_t f = std::min(e, b + kBlock);
            reduce_range(s.op, s.dtype, b, f, srcs, acc);
            convert(acc, DType::f32, static_cast<char*>(outs[r]) + b * esz, s.dtype, f - b);
          }
        }
        continue;
      }
      if (one_pass) {
        sum_to_all(ins.data(), outs32.data(), R, lo, hi - lo, s.op == ReduceOp::avg);
        continue;
      }
      for (size_t b = lo; b < hi; b += kBlock) {
        const size_t e = std::min(hi, b + kBlock);
        reduce_range(s.op, s.dtype, b, e, srcs, acc);
        for (int r = 0; r < R; ++r) convert(acc, DType::f32, static_cast<char*>(outs[r]) + b * esz, s.dtype, e - b);
      }
    }
  }

  void run(const Slot& s) {
    const int R = size();
    const char* what = kind_name(s.kind);
    if (state_->aborted()) throw CommError(state_->why());
    state_->slot(rank_) = s;
    state_->barrier(rank_, what);
    check_match();
    const size_t esz = dtype_size(s.dtype);
    std::vector<const void*> srcs(R);
    for (int r = 0; r < R; ++r) srcs[r] = state_->slot(r).send;
    switch (s.kind) {
      case Kind::barrier:
        // A second meeting, so no rank's next collective overwrites its slot while a slower rank
        // still compares against it.
        state_->barrier(rank_, what);
        return;
      case Kind::all_reduce:
      case Kind::reduce_scatter_v: {
        if ((s.dtype == DType::i32 || s.dtype == DType::u8))
          throw CommError(std::string(what) + ": " + dtype_name(s.dtype) + " is not reducible; use f32, f16 or bf16");
        // One rank in place (a process's only replica under MPI): the input is the result, and
        // the block loop below would cost a full read and write of the message.
        if (R == 1 && s.send == s.recv) return;
        reduce_claimed_units(s, srcs);
        state_->barrier(rank_, what);  // every unit is in every output before anyone returns
        return;
      }
      case Kind::broadcast:
        if (rank_ != s.root) std::memcpy(s.recv, srcs[s.root], s.count * esz);
        state_->barrier(rank_, what);  // the root may not change its buffer before all copied
        return;
      case Kind::all_gather_v:
        // Each rank copies the others' ranges into its own buffer; an owner's range is only read
        // until the closing barrier, and it writes the other ranges of its buffer meanwhile.
        for (int r = 0; r < R; ++r)
          if (r != rank_)
            std::memcpy(static_cast<char*>(s.recv) + s.bounds[r] * esz,
                        static_cast<const char*>(srcs[r]) + s.bounds[r] * esz, (s.bounds[r + 1] - s.bounds[r]) * esz);
        state_->barrier(rank_, what);
        return;
      case Kind::all_gather:
        for (int r = 0; r < R; ++r)
          std::memcpy(static_cast<char*>(s.recv) + r * s.count * esz, srcs[r], s.count * esz);
        state_->barrier(rank_, what);
        return;
      case Kind::reduce_scatter: {
        std::vector<float> out(std::max<size_t>(s.count, 1));
        const size_t lo = rank_ * s.count;
        reduce_range(s.op, s.dtype, lo, lo + s.count, srcs, out.data());
        convert(out.data(), DType::f32, s.recv, s.dtype, s.count);
        state_->barrier(rank_, what);
        return;
      }
    }
  }

  std::shared_ptr<HostCommState> state_;
  int rank_;
  CollectiveQueue queue_;  // last: its worker may run collectives that use the members above
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_host_communicators(int world, HostCommOptions opts) {
  if (world < 1) throw CommError("host communicator: world size must be >= 1");
  auto state = std::make_shared<HostCommState>(world, opts);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < world; ++r) out.push_back(std::make_unique<HostCommunicator>(state, r));
  return out;
}

}  // namespace replica::parallel
