// The CUDA backend's linear layer: cuBLAS GEMMs with f32 accumulation (tensor cores for 16-bit
// data, TF32 for f32 only when asked) and the bias kernels of elementwise.cu.
#include "ops/cuda/cuda_backend_impl.h"

namespace replica::ops::cuda_impl {

namespace {

cudaDataType_t blas_type(DType t) {
  switch (t) {
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

}  // namespace

void CudaBackend::linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y) {
  const int N = as_int(x.dim(0), "linear"), I = as_int(x.numel() / x.dim(0), "linear"), O = as_int(w.dim(0), "linear");
  check_linear(x, w, I, O);
  auto& ts = state();
  // y = b broadcast, then y += x w^T: column-major y^T[O,N] = w^T' [O,I] x^T [I,N].
  cuk::bias_broadcast(dp(b), dp(y), N, O, stream());
  gemm(ts, CUBLAS_OP_T, CUBLAS_OP_N, O, N, I, w, I, x, I, 1.f, y, O);
}

void CudaBackend::linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                     const Tensor& db) {
  const int N = as_int(x.dim(0), "linear"), I = as_int(x.numel() / x.dim(0), "linear"), O = as_int(w.dim(0), "linear");
  check_linear(x, w, I, O);
  require_f32(dw, "linear_backward (weight gradient)");
  require_f32(db, "linear_backward (bias gradient)");
  auto& ts = state();
  if (dx.defined()) gemm(ts, CUBLAS_OP_N, CUBLAS_OP_N, I, N, O, w, I, dy, O, 0.f, dx, I);  // dx = dy w
  gemm(ts, CUBLAS_OP_N, CUBLAS_OP_T, I, O, N, x, I, dy, O, 1.f, dw, I);                   // dw += dy^T x
  cuk::bias_grad(dp(dy), db.data<float>(), N, O, stream());
}

void CudaBackend::check_linear(const Tensor& x, const Tensor& w, int I, int O) {
  if (w.numel() != static_cast<int64_t>(O) * I)
    throw ShapeError("linear: input " + x.str() + " has " + std::to_string(I) + " features but the weight is " + w.str());
  if (x.dtype() != w.dtype())
    throw ShapeError("linear: input " + x.str() + " and weight " + w.str() + " must share a dtype on the GPU");
}

// Column-major C[m,n] = alpha op(A) op(B) + beta C with f32 accumulation (tensor cores for 16-bit
// data; TF32 for f32 only under REPLICA_ALLOW_TF32).
void CudaBackend::gemm(ThreadState& ts, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const Tensor& A,
                 int lda, const Tensor& B, int ldb, float beta, const Tensor& C, int ldc) {
  const float alpha = 1.f;
  const cublasComputeType_t ct =
      A.dtype() == DType::f32 && allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  REPLICA_CUBLAS_CHECK(cublasGemmEx(ts.cublas, ta, tb, m, n, k, &alpha, A.raw(), blas_type(A.dtype()), lda, B.raw(),
                                    blas_type(B.dtype()), ldb, &beta, C.raw(), blas_type(C.dtype()), ldc, ct,
                                    CUBLAS_GEMM_DEFAULT));
}

}  // namespace replica::ops::cuda_impl
