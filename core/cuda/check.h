// CUDA_CHECK: turns a failed CUDA runtime call into a CudaError naming the call, file and line.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "core/errors.h"

#define REPLICA_CUDA_CHECK(expr)                                                              \
  do {                                                                                        \
    cudaError_t err_ = (expr);                                                                \
    if (err_ != cudaSuccess)                                                                  \
      throw ::replica::CudaError(std::string(#expr) + " failed: " + cudaGetErrorString(err_) + \
                                 " at " + __FILE__ + ":" + std::to_string(__LINE__));         \
  } while (0)
