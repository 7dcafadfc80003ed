// DeviceGuard: makes a CUDA device the calling thread's current one for a scope and puts back the
// device that was current before (c10's CUDAGuard). Every entry point that touches a device holds
// one, so nothing depends on, or changes, the caller's current device: discovery, the cudaMalloc
// upstream, streams and their events, NCCL set-up and tear-down. Plain C++ (no CUDA header): the
// device calls come through a DeviceApi, which a CPU test replaces with a fake.
#pragma once

namespace replica::cuda {

struct DeviceApi {
  int (*get)();      // the calling thread's current device
  void (*set)(int);  // make a device current (throws CudaError on failure)
};
// The CUDA runtime's cudaGetDevice / cudaSetDevice (a "not built" error without CUDA).
const DeviceApi& runtime_device_api();

class DeviceGuard {
 public:
  explicit DeviceGuard(int device, const DeviceApi& api = runtime_device_api()) : api_(api) {
    previous_ = api_.get();
    if (previous_ != device) api_.set(device);  // already current: nothing to do, nothing to undo
    changed_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (changed_) api_.set(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  int previous() const { return previous_; }

 private:
  const DeviceApi& api_;
  int previous_ = 0;
  bool changed_ = false;
};

}  // namespace replica::cuda
