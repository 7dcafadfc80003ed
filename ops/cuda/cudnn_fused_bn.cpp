// cuDNN's fused batch norm + add + ReLU, for `replica bench kernels` (ops/cuda/cudnn_fused_bn.h).
#include "ops/cuda/cudnn_fused_bn.h"

#include <cuda_runtime.h>
#include <cudnn.h>

#include <string>

#include "core/errors.h"
#include "core/stream.h"

// The Ex batch-norm calls are deprecated in cuDNN 9 in favour of the graph API, and still ship
// (libcudnn_ops): measuring them is the point, so their warnings are not errors here.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace replica::ops {
namespace {

void check(cudnnStatus_t st, const char* what) {
  if (st != CUDNN_STATUS_SUCCESS)
    throw CudaError(std::string("cuDNN's fused batch norm + add + ReLU: ") + what + ": " +
                    cudnnGetErrorString(st));
}

constexpr cudnnBatchNormMode_t kMode = CUDNN_BATCHNORM_SPATIAL_PERSISTENT;
constexpr cudnnBatchNormOps_t kOps = CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION;

// The handle and descriptors of one thread, set to one shape and to the thread's current stream.
struct Descs {
  cudnnHandle_t h{};
  cudnnTensorDescriptor_t x{}, bn{};
  cudnnActivationDescriptor_t relu{};
  Descs() {
    check(cudnnCreate(&h), "cudnnCreate");
    check(cudnnCreateTensorDescriptor(&x), "cudnnCreateTensorDescriptor");
    check(cudnnCreateTensorDescriptor(&bn), "cudnnCreateTensorDescriptor");
    check(cudnnCreateActivationDescriptor(&relu), "cudnnCreateActivationDescriptor");
    check(cudnnSetActivationDescriptor(relu, CUDNN_ACTIVATION_RELU, CUDNN_NOT_PROPAGATE_NAN, 0.0),
          "cudnnSetActivationDescriptor");
  }
  ~Descs() {
    cudnnDestroyActivationDescriptor(relu);
    cudnnDestroyTensorDescriptor(bn);
    cudnnDestroyTensorDescriptor(x);
    cudnnDestroy(h);
  }
};

Descs& descs_for(const Tensor& x) {
  thread_local Descs d;
  if (x.shape().rank() != 4 || (x.dtype() != DType::f16 && x.dtype() != DType::bf16))
    throw ShapeError("cuDNN's fused batch norm + add + ReLU: expected a 16-bit NHWC tensor, got " +
                     x.str());
  const cudnnDataType_t t = x.dtype() == DType::f16 ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16;
  check(cudnnSetTensor4dDescriptor(d.x, CUDNN_TENSOR_NHWC, t, static_cast<int>(x.dim(0)),
                                   static_cast<int>(x.dim(3)), static_cast<int>(x.dim(1)),
                                   static_cast<int>(x.dim(2))),
        "cudnnSetTensor4dDescriptor");
  check(cudnnDeriveBNTensorDescriptor(d.bn, d.x, kMode), "cudnnDeriveBNTensorDescriptor");
  Stream* s = current_stream();
  check(cudnnSetStream(d.h, s ? static_cast<cudaStream_t>(s->native()) : nullptr),
        "cudnnSetStream");
  return d;
}

Tensor workspace(MemoryPool& ws, size_t bytes) {
  return bytes ? Tensor::empty(ws, {static_cast<int64_t>(bytes)}, DType::u8, MemTag::workspace)
               : Tensor();
}
void* raw_or_null(const Tensor& t) { return t.defined() ? t.raw() : nullptr; }

}  // namespace

size_t cudnn_join_reserve_bytes(const Tensor& x) {
  Descs& d = descs_for(x);
  size_t bytes = 0;
  check(cudnnGetBatchNormalizationTrainingExReserveSpaceSize(d.h, kMode, kOps, d.relu, d.x, &bytes),
        "cudnnGetBatchNormalizationTrainingExReserveSpaceSize");
  return bytes;
}

void cudnn_join_forward(const CudnnJoin& j, float momentum, float eps, MemoryPool& ws) {
  Descs& d = descs_for(j.x);
  size_t bytes = 0;
  check(cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(d.h, kMode, kOps, d.x, d.x, d.x,
                                                                 d.bn, d.relu, &bytes),
        "cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize");
  const Tensor w = workspace(ws, bytes);
  const float one = 1.f, zero = 0.f;
  check(cudnnBatchNormalizationForwardTrainingEx(
            d.h, kMode, kOps, &one, &zero, d.x, j.x.raw(), d.x, j.residual.raw(), d.x, j.y.raw(),
            d.bn, j.gamma.raw(), j.beta.raw(), momentum, j.running_mean.raw(), j.running_var.raw(),
            eps, j.save_mean.raw(), j.save_invstd.raw(), d.relu, raw_or_null(w), bytes,
            raw_or_null(j.reserve), j.reserve.defined() ? j.reserve.nbytes() : 0),
        "cudnnBatchNormalizationForwardTrainingEx");
}

void cudnn_join_backward(const CudnnJoin& j, float eps, MemoryPool& ws) {
  Descs& d = descs_for(j.x);
  size_t bytes = 0;
  check(cudnnGetBatchNormalizationBackwardExWorkspaceSize(d.h, kMode, kOps, d.x, d.x, d.x, d.x, d.x,
                                                          d.bn, d.relu, &bytes),
        "cudnnGetBatchNormalizationBackwardExWorkspaceSize");
  const Tensor w = workspace(ws, bytes);
  const float one = 1.f, zero = 0.f;
  check(cudnnBatchNormalizationBackwardEx(
            d.h, kMode, kOps, &one, &zero, &one, &one, d.x, j.x.raw(), d.x, j.y.raw(), d.x,
            j.dy.raw(), d.x, j.dresidual.raw(), d.x, j.dx.raw(), d.bn, j.gamma.raw(), j.beta.raw(),
            j.dgamma.raw(), j.dbeta.raw(), eps, j.save_mean.raw(), j.save_invstd.raw(), d.relu,
            raw_or_null(w), bytes, raw_or_null(j.reserve),
            j.reserve.defined() ? j.reserve.nbytes() : 0),
        "cudnnBatchNormalizationBackwardEx");
}

}  // namespace replica::ops
