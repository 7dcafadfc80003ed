// RecordableCommunicator: a CPU replica's communicator whose collectives a step recording holds.
#include "parallel/recordable_communicator.h"

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
  CaptureHolds* capture_holds() override { return c_->capture_holds(); }
  WorkHandle stream_work(Stream& s, const char* what) override { return c_->stream_work(s, what); }

  // While the thread records, an async collective is its blocking form (below), recorded: the
  // work handed back is done, since nothing runs while recording. Otherwise the wrapped one's.
  WorkHandle all_reduce_async(void* d, size_t n, DType t, ReduceOp op) override {
    if (!call_recording()) return c_->all_reduce_async(d, n, t, op);
    all_reduce(d, n, t, op);
    return done();
  }
  WorkHandle broadcast_async(void* d, size_t n, DType t, int root) override {
    if (!call_recording()) return c_->broadcast_async(d, n, t, root);
    broadcast(d, n, t, root);
    return done();
  }
  WorkHandle all_gather_async(const void* s, void* r, size_t n, DType t) override {
    if (!call_recording()) return c_->all_gather_async(s, r, n, t);
    all_gather(s, r, n, t);
    return done();
  }
  WorkHandle reduce_scatter_async(const void* s, void* r, size_t n, DType t, ReduceOp op) override {
    if (!call_recording()) return c_->reduce_scatter_async(s, r, n, t, op);
    reduce_scatter(s, r, n, t, op);
    return done();
  }
  WorkHandle barrier_async() override {
    if (!call_recording()) return c_->barrier_async();
    barrier();
    return done();
  }
  WorkHandle reduce_scatter_v_async(void* d, size_t n, DType t, ReduceOp op, const std::vector<size_t>& b) override {
    if (!call_recording()) return c_->reduce_scatter_v_async(d, n, t, op, b);
    reduce_scatter_v(d, n, t, op, b);
    return done();
  }
  WorkHandle all_gather_v_async(void* d, size_t n, DType t, const std::vector<size_t>& b) override {
    if (!call_recording()) return c_->all_gather_v_async(d, n, t, b);
    all_gather_v(d, n, t, b);
    return done();
  }

  // The blocking forms: the wrapped communicator's own (it may run them on this thread), or,
  // while recording, the same call added to the recording, run in its place on each replay (the
  // recorded calls after it read its result, as a graph's nodes after a collective's node do).
  void all_reduce(void* d, size_t n, DType t, ReduceOp op) override {
    if (auto* r = call_recording()) return r->add([c = c_.get(), d, n, t, op] { c->all_reduce(d, n, t, op); });
    c_->all_reduce(d, n, t, op);
  }
  void broadcast(void* d, size_t n, DType t, int root) override {
    if (auto* r = call_recording()) return r->add([c = c_.get(), d, n, t, root] { c->broadcast(d, n, t, root); });
    c_->broadcast(d, n, t, root);
  }
  void all_gather(const void* s, void* rv, size_t n, DType t) override {
    if (auto* r = call_recording()) return r->add([c = c_.get(), s, rv, n, t] { c->all_gather(s, rv, n, t); });
    c_->all_gather(s, rv, n, t);
  }
  void reduce_scatter(const void* s, void* rv, size_t n, DType t, ReduceOp op) override {
    if (auto* r = call_recording())
      return r->add([c = c_.get(), s, rv, n, t, op] { c->reduce_scatter(s, rv, n, t, op); });
    c_->reduce_scatter(s, rv, n, t, op);
  }
  void barrier() override {
    if (auto* r = call_recording()) return r->add([c = c_.get()] { c->barrier(); });
    c_->barrier();
  }
  void reduce_scatter_v(void* d, size_t n, DType t, ReduceOp op, const std::vector<size_t>& b) override {
    if (auto* r = call_recording())
      return r->add([c = c_.get(), d, n, t, op, b] { c->reduce_scatter_v(d, n, t, op, b); });
    c_->reduce_scatter_v(d, n, t, op, b);
  }
  void all_gather_v(void* d, size_t n, DType t, const std::vector<size_t>& b) override {
    if (auto* r = call_recording()) return r->add([c = c_.get(), d, n, t, b] { c->all_gather_v(d, n, t, b); });
    c_->all_gather_v(d, n, t, b);
  }

 private:
  static WorkHandle done() { return std::make_shared<DoneWork>(); }

  std::unique_ptr<Communicator> c_;
};

}  // namespace

std::unique_ptr<Communicator> make_recordable_communicator(std::unique_ptr<Communicator> inner) {
  return std::make_unique<RecordableCommunicator>(std::move(inner));
}

}  // namespace replica::parallel
