// The CUDA op backend (cuDNN, cuBLAS, hand-written kernels). Declared without CUDA headers.
#pragma once
#include "ops/backend.h"

namespace replica::ops {

// The shared CUDA backend instance; throws CudaError when it is not available in this build.
Backend& cuda_backend();

}  // namespace replica::ops
