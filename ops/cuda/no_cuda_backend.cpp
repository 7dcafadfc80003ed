// Built instead of the CUDA op backend when CUDA or cuDNN is not part of the build: asking for it
// says so plainly instead of failing inside a kernel.
#include "core/errors.h"
#include "ops/cuda/cuda_backend.h"
#include "ops/cuda/cudnn_fused_bn.h"

namespace replica::ops {

Backend& cuda_backend() {
  throw CudaError(
      "this replica was built without the CUDA op backend (no nvcc, cuDNN or cuBLAS at configure "
      "time); rebuild with -DREPLICA_CUDA=ON where the CUDA toolkit and cuDNN are installed, or "
      "train on CPU replicas with --devices cpu:N");
}

std::string cuda_library_versions() { return "cuDNN/cuBLAS: not built"; }

size_t cudnn_join_reserve_bytes(const Tensor&) { throw CudaError("cuDNN's fused batch norm: not built"); }
void cudnn_join_forward(const CudnnJoin&, float, float, MemoryPool&) {
  throw CudaError("cuDNN's fused batch norm: not built");
}
void cudnn_join_backward(const CudnnJoin&, float, MemoryPool&) { throw CudaError("cuDNN's fused batch norm: not built"); }

}  // namespace replica::ops
