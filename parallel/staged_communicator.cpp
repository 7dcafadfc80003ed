// StagedCommunicator: device buffers in, a host communicator underneath.
#include "parallel/staged_communicator.h"

#include <vector>

#include "core/cuda/runtime.h"
#include "core/errors.h"

namespace replica::parallel {
namespace {

class StagedCommunicator : public Communicator {
 public:
  StagedCommunicator(std::unique_ptr<Communicator> host, StagingCopy copy)
      : host_(std::move(host)), copy_(std::move(copy)) {
    if (host_->device_buffers()) throw CommError("a staged communicator wraps a host communicator, not " + host_->name());
    if (!copy_) copy_ = [](void* d, const void* s, size_t n) { cuda::copy(d, s, n, nullptr); };
  }
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::string name() const override { return host_->name() + " (host-staged)"; }
  bool device_buffers() const override { return true; }
  std::string cuda_graph_refusal() const override {
    return "the collectives of " + name() + " are staged through host memory: a graph cannot hold them";
  }

  WorkHandle all_reduce_async(void* d, size_t n, DType t, ReduceOp op) override {
    char* h = stage(d, n * dtype_size(t), 0);
    host_->all_reduce(h, n, t, op);
    copy_(d, h, n * dtype_size(t));
    return done();
  }
  WorkHandle broadcast_async(void* d, size_t n, DType t, int root) override {
    char* h = stage(d, n * dtype_size(t), 0);
    host_->broadcast(h, n, t, root);
    copy_(d, h, n * dtype_size(t));
    return done();
  }
  WorkHandle all_gather_async(const void* s, void* r, size_t n, DType t) override {
    const size_t in = n * dtype_size(t), out = in * static_cast<size_t>(size());
    char* h = stage(s, in, out);
    host_->all_gather(h, h + in, n, t);
    copy_(r, h + in, out);
    return done();
  }
  WorkHandle reduce_scatter_async(const void* s, void* r, size_t n, DType t, ReduceOp op) override {
    const size_t out = n * dtype_size(t), in = out * static_cast<size_t>(size());
    char* h = stage(s, in, out);
    host_->reduce_scatter(h, h + in, n, t, op);
    copy_(r, h + in, out);
    return done();
  }
  WorkHandle reduce_scatter_v_async(void* d, size_t n, DType t, ReduceOp op, const std::vector<size_t>& b) override {
    check_bounds("reduce_scatter_v", n, b);
    const size_t es = dtype_size(t), lo = b[rank()], hi = b[rank() + 1];
    char* h = stage(d, n * es, 0);
    host_->reduce_scatter_v(h, n, t, op, b);
    copy_(static_cast<char*>(d) + lo * es, h + lo * es, (hi - lo) * es);  // only the owned range changed
    return done();
  }
  WorkHandle all_gather_v_async(void* d, size_t n, DType t, const std::vector<size_t>& b) override {
    check_bounds("all_gather_v", n, b);
    char* h = stage(d, n * dtype_size(t), 0);
    host_->all_gather_v(h, n, t, b);
    copy_(d, h, n * dtype_size(t));
    return done();
  }
  WorkHandle barrier_async() override {
    host_->barrier();
    return done();
  }
  void abort(const std::string& why) override { host_->abort(why); }

 private:
  // Host buffer of `bytes + extra`, holding a copy of the first `bytes` of `src`.
  char* stage(const void* src, size_t bytes, size_t extra) {
    if (buf_.size() < bytes + extra) buf_.resize(bytes + extra);
    copy_(buf_.data(), src, bytes);
    return buf_.data();
  }
  static WorkHandle done() { return std::make_shared<DoneWork>(); }

  std::unique_ptr<Communicator> host_;
  StagingCopy copy_;
  std::vector<char> buf_;
};

}  // namespace

std::unique_ptr<Communicator> make_staged_communicator(std::unique_ptr<Communicator> host, StagingCopy copy) {
  return std::make_unique<StagedCommunicator>(std::move(host), std::move(copy));
}

}  // namespace replica::parallel
