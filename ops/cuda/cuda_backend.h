// The CUDA op backend (cuDNN, cuBLAS, hand-written kernels). Declared without CUDA headers.
#pragma once
#include <string>

#include "ops/backend.h"

namespace replica::ops {

// The shared CUDA backend instance; throws CudaError when it is not available in this build.
Backend& cuda_backend();
// The cuDNN and cuBLAS versions this process loaded (and cuDNN's compiled-against version), for
// `replica devices` and the GPU check; "not built" without the CUDA op backend.
std::string cuda_library_versions();

}  // namespace replica::ops
