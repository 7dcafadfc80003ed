// CUDA op backend entry point. The cuDNN/cuBLAS kernels are not written yet (issue 6), so asking
// for one says so plainly instead of failing inside a kernel.
#include "ops/cuda/cuda_backend.h"

#include "core/errors.h"

namespace replica::ops {

Backend& cuda_backend() {
  throw CudaError(
      "the CUDA op backend (cuDNN/cuBLAS kernels) is not part of this build yet; core CUDA "
      "support (devices, pools, streams) is. Train on CPU replicas with --devices cpu:N");
}

}  // namespace replica::ops
