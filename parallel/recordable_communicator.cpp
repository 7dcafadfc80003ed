// RecordableCommunicator: a CPU replica's communicator whose collectives a step recording holds.
#include "parallel/recordable_communicator.h"

#include <functional>
#include <utility>
#include <vector>

#include "core/captured_work.h"
#include "core/errors.h"

namespace replica::parallel {
namespace {

class RecordableCommunicator final : public Communicator {
 public:
  explicit RecordableCommunicator(std::unique_ptr<Communicator> inner) : c_(std::move(inner)) {
    if (c_->device_buffers())
      throw CommError("a recordable communicator wraps a host communicator, not " + c_->name() +
                      " (a CUDA graph captures device collectives itself)");
  }
  int rank() const override { return c_->rank(); }
  int size() const override { return c_->size(); }
  std::string name() const override { return c_->name(); }
  bool device_buffers() const override { return false; }
  bool maps_peer_buffers() const override { return c_->maps_peer_buffers(); }
  void abort(const std::string& why) override { c_->abort(why); }
  WorkHandle stream_work(Stream& s, const char* what) override { return c_->stream_work(s, what); }

  // Recorded, a collective runs in its blocking form when replayed: the recorded calls after it
  // read its result, as a graph's nodes after a collective's node do. The work handed back now is
  // done (nothing is pending while recording: nothing runs).
  WorkHandle all_reduce_async(void* d, size_t n, DType t, ReduceOp op) override {
    if (record([c = c_.get(), d, n, t, op] { c->all_reduce(d, n, t, op); })) return done();
    return c_->all_reduce_async(d, n, t, op);
  }
  WorkHandle broadcast_async(void* d, size_t n, DType t, int root) override {
    if (record([c = c_.get(), d, n, t, root] { c->broadcast(d, n, t, root); })) return done();
    return c_->broadcast_async(d, n, t, root);
  }
  WorkHandle all_gather_async(const void* s, void* r, size_t n, DType t) override {
    if (record([c = c_.get(), s, r, n, t] { c->all_gather(s, r, n, t); })) return done();
    return c_->all_gather_async(s, r, n, t);
  }
  WorkHandle reduce_scatter_async(const void* s, void* r, size_t n, DType t, ReduceOp op) override {
    if (record([c = c_.get(), s, r, n, t, op] { c->reduce_scatter(s, r, n, t, op); })) return done();
    return c_->reduce_scatter_async(s, r, n, t, op);
  }
  WorkHandle barrier_async() override {
    if (record([c = c_.get()] { c->barrier(); })) return done();
    return c_->barrier_async();
  }
  WorkHandle reduce_scatter_v_async(void* d, size_t n, DType t, ReduceOp op, const std::vector<size_t>& b) override {
    if (call_recording() && record([c = c_.get(), d, n, t, op, b] { c->reduce_scatter_v(d, n, t, op, b); }))
      return done();
    return c_->reduce_scatter_v_async(d, n, t, op, b);
  }
  WorkHandle all_gather_v_async(void* d, size_t n, DType t, const std::vector<size_t>& b) override {
    if (call_recording() && record([c = c_.get(), d, n, t, b] { c->all_gather_v(d, n, t, b); })) return done();
    return c_->all_gather_v_async(d, n, t, b);
  }

  // The blocking forms keep the wrapped communicator's own (it may run them on this thread).
  void all_reduce(void* d, size_t n, DType t, ReduceOp op) override {
    if (!record([c = c_.get(), d, n, t, op] { c->all_reduce(d, n, t, op); })) c_->all_reduce(d, n, t, op);
  }
  void broadcast(void* d, size_t n, DType t, int root) override {
    if (!record([c = c_.get(), d, n, t, root] { c->broadcast(d, n, t, root); })) c_->broadcast(d, n, t, root);
  }
  void all_gather(const void* s, void* r, size_t n, DType t) override {
    if (!record([c = c_.get(), s, r, n, t] { c->all_gather(s, r, n, t); })) c_->all_gather(s, r, n, t);
  }
  void reduce_scatter(const void* s, void* r, size_t n, DType t, ReduceOp op) override {
    if (!record([c = c_.get(), s, r, n, t, op] { c->reduce_scatter(s, r, n, t, op); }))
      c_->reduce_scatter(s, r, n, t, op);
  }
  void barrier() override {
    if (!record([c = c_.get()] { c->barrier(); })) c_->barrier();
  }
  void reduce_scatter_v(void* d, size_t n, DType t, ReduceOp op, const std::vector<size_t>& b) override {
    if (!call_recording() || !record([c = c_.get(), d, n, t, op, b] { c->reduce_scatter_v(d, n, t, op, b); }))
      c_->reduce_scatter_v(d, n, t, op, b);
  }
  void all_gather_v(void* d, size_t n, DType t, const std::vector<size_t>& b) override {
    if (!call_recording() || !record([c = c_.get(), d, n, t, b] { c->all_gather_v(d, n, t, b); }))
      c_->all_gather_v(d, n, t, b);
  }

 private:
  // True when a recording is open on this thread and took the call. A template, so that the
  // calls made outside a recording (every eager step) build no std::function.
  template <class Call>
  static bool record(Call&& call) {
    CallRecording* r = call_recording();
    if (!r) return false;
    r->add(std::function<void()>(std::forward<Call>(call)));
    return true;
  }
  static WorkHandle done() { return std::make_shared<DoneWork>(); }

  std::unique_ptr<Communicator> c_;
};

}  // namespace

std::unique_ptr<Communicator> make_recordable_communicator(std::unique_ptr<Communicator> inner) {
  return std::make_unique<RecordableCommunicator>(std::move(inner));
}

}  // namespace replica::parallel
