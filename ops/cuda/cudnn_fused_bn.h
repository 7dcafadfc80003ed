// cuDNN's own fused batch norm + add + ReLU (cudnnBatchNormalizationForwardTrainingEx and
// cudnnBatchNormalizationBackwardEx with CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION and the persistent
// NHWC kernels: the path NVIDIA's MXNet ResNet-50 took in MLPerf). #40 asks whether the backend's
// residual join should be cuDNN's or its own kernels, chosen by measurement: `replica bench
// kernels --kind cuda` times this beside the backend's own join on ResNet-50's shapes. Declared
// without CUDA headers; throws CudaError naming cuDNN's status where cuDNN does not serve a shape
// or dtype (that answer is a measurement too), and "not built" without the CUDA op backend.
#pragma once
#include <cstddef>

#include "core/memory_pool.h"
#include "core/tensor.h"

namespace replica::ops {

// A residual join's tensors: x, residual, y and their gradients of one NHWC shape in one 16-bit
// dtype; gamma, beta, the statistics and their gradients f32 [C]; `reserve` u8 of
// cudnn_join_reserve_bytes (the ReLU's mask the forward leaves for the backward).
struct CudnnJoin {
  Tensor x, residual, y, gamma, beta, save_mean, save_invstd, running_mean, running_var, reserve;
  Tensor dy, dx, dresidual, dgamma, dbeta;
};
size_t cudnn_join_reserve_bytes(const Tensor& x);
// y = relu(bn(x) + residual) with batch statistics (saved, and the running ones updated by
// `momentum`), on the calling thread's stream; workspace from `ws`.
void cudnn_join_forward(const CudnnJoin& j, float momentum, float eps, MemoryPool& ws);
// dx (batch norm's input gradient), dresidual (the ReLU-masked dy) and dgamma, dbeta (+=).
void cudnn_join_backward(const CudnnJoin& j, float eps, MemoryPool& ws);

}  // namespace replica::ops
