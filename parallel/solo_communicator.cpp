// SoloCommunicator implementation: identities and copies, finished before they return.
#include "parallel/solo_communicator.h"

#include <cstring>

#include "core/cuda/runtime.h"
#include "core/errors.h"

namespace replica::parallel {
namespace {

class SoloCommunicator : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "solo"; }

  WorkHandle all_reduce_async(void*, size_t, DType, ReduceOp) override { return check(); }
  WorkHandle broadcast_async(void*, size_t, DType, int root) override {
    if (root != 0) throw CommError("broadcast: root " + std::to_string(root) + " is not a rank (world of 1)");
    return check();
  }
  WorkHandle all_gather_async(const void* send, void* recv, size_t count, DType dtype) override {
    check();
    copy(recv, send, count * dtype_size(dtype));
    return std::make_shared<DoneWork>();
  }
  WorkHandle reduce_scatter_async(const void* send, void* recv, size_t count, DType dtype, ReduceOp) override {
    check();
    copy(recv, send, count * dtype_size(dtype));
    return std::make_shared<DoneWork>();
  }
  WorkHandle barrier_async() override { return check(); }
  // One rank owns everything: the reduction of one contribution is itself (avg divides by 1).
  WorkHandle reduce_scatter_v_async(void*, size_t n, DType, ReduceOp, const std::vector<size_t>& b) override {
    check_bounds("reduce_scatter_v", n, b);
    return check();
  }
  WorkHandle all_gather_v_async(void*, size_t n, DType, const std::vector<size_t>& b) override {
    check_bounds("all_gather_v", n, b);
    return check();
  }
  void abort(const std::string& why) override { aborted_ = why; }

 private:
  WorkHandle check() {
    if (!aborted_.empty()) throw CommError("communicator aborted: " + aborted_);
    return std::make_shared<DoneWork>();
  }
  // Host or device memory on either side: CUDA copies (and waits) when a GPU is involved.
  static void copy(void* dst, const void* src, size_t bytes) {
    if (dst == src || bytes == 0) return;
    if (cuda::is_device_pointer(dst) || cuda::is_device_pointer(src)) cuda::copy(dst, src, bytes, nullptr);
    else std::memmove(dst, src, bytes);
  }
  std::string aborted_;
};

}  // namespace

std::unique_ptr<Communicator> make_solo_communicator() { return std::make_unique<SoloCommunicator>(); }

}  // namespace replica::parallel
