// The CUDA op backend's internals, shared by its files: the status checks of cuDNN and cuBLAS, the
// small argument helpers, the per-thread state (handles, convolution plans, scratch, kept tables)
// and the CudaBackend class, whose methods are defined by concern: cuda_backend.cpp (dispatch,
// elementwise, pooling, loss, reductions, host reads), cudnn_conv.cpp (convolutions),
// cuda_batch_norm.cpp, cublas_linear.cpp and cuda_optimizers.cpp. Included by those files only.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/cuda/check.h"
#include "core/env.h"
#include "core/errors.h"
#include "core/stream.h"
#include "ops/backend.h"
#include "ops/cuda/kernels.h"

#define REPLICA_CUDNN_CHECK(expr)                                                                   \
  do {                                                                                              \
    cudnnStatus_t st_ = (expr);                                                                     \
    if (st_ != CUDNN_STATUS_SUCCESS)                                                                \
      throw ::replica::CudaError(std::string(#expr) + " failed: " + cudnnGetErrorString(st_) + " at " + \
                                 __FILE__ + ":" + std::to_string(__LINE__));                        \
  } while (0)

#define REPLICA_CUBLAS_CHECK(expr)                                                                       \
  do {                                                                                                   \
    cublasStatus_t st_ = (expr);                                                                         \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                                    \
      throw ::replica::CudaError(std::string(#expr) + " failed: " + cublasGetStatusString(st_) + " at " + \
                                 __FILE__ + ":" + std::to_string(__LINE__));                             \
  } while (0)

namespace replica::ops::cuda_impl {

inline cuk::DPtr dp(const Tensor& t) { return {t.raw(), static_cast<int>(t.dtype())}; }
// Scratch regions start on 256-byte boundaries (what cudaMalloc guarantees for the first).
inline size_t align_up(size_t bytes) { return (bytes + 255) & ~size_t(255); }

inline void require_float(const Tensor& t, const char* who) {
  if (t.dtype() != DType::f32 && t.dtype() != DType::f16 && t.dtype() != DType::bf16)
    throw ShapeError(std::string(who) + ": expected f32, f16 or bf16, got " + t.str());
}
inline void require_f32(const Tensor& t, const char* who) {
  if (t.dtype() != DType::f32) throw ShapeError(std::string(who) + ": expected f32, got " + t.str());
}
inline void require_same(const Tensor& a, const Tensor& b, const char* who) {
  if (a.numel() != b.numel()) throw ShapeError(std::string(who) + ": " + a.str() + " and " + b.str() + " differ in size");
}
// The optimizer updates' 16-bit copy (Backend::sgd_update), checked: none, or f16 / bf16 of p's size.
inline cuk::DPtr copy_ptr(const Tensor& copy, const Tensor& p, const char* who) {
  check_copy(copy, p, who);
  return copy.defined() ? dp(copy) : cuk::DPtr{};
}
// A StepScalar as the kernels take it, checked (ShapeError naming `who`).
inline cuk::Knob knob(const StepScalar& s, const Tensor& y, const char* who) {
  check_step_scalar(s, y, who);
  return {s.value, s.at.defined() ? s.at.data<float>() : nullptr};
}
// The update's gate (null when there is none).
inline const float* gate_ptr(const Tensor& gate) { return gate.defined() ? gate.data<float>() : nullptr; }
// The group table's entries (null when there is none).
static_assert(ops::kParamChunk == (1 << cuk::kChunkShift), "the kernels' chunk is the flat buffer's");
template <typename T>
inline const T* table(const ChunkClasses& c) {
  return c.table.defined() ? c.table.data<T>() : nullptr;
}
inline int as_int(int64_t v, const char* who) {
  if (v > 0x7fffffff) throw ShapeError(std::string(who) + ": dimension " + std::to_string(v) + " exceeds 2^31");
  return static_cast<int>(v);
}

inline cudaStream_t stream() {
  Stream* s = current_stream();
  return s ? static_cast<cudaStream_t>(s->native()) : nullptr;
}

// Whether this thread's stream is being captured into a CUDA graph (train.cuda_graph): what
// must not happen inside a capture (a copy from a pageable host buffer, which every replay would
// read after it is freed; cuDNN's timed algorithm search; growing a buffer) checks it first.
inline bool capturing() {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  REPLICA_CUDA_CHECK(cudaStreamIsCapturing(stream(), &cs));
  return cs != cudaStreamCaptureStatusNone;
}

// TF32 for f32 convolutions and GEMMs (PyTorch's default for cuDNN convolutions) only when asked:
// f32 runs are the ones compared against the CPU backend.
inline bool allow_tf32() { return env_flag("REPLICA_ALLOW_TF32"); }
// Deterministic mode (Backend::set_deterministic; train.deterministic, REPLICA_DETERMINISTIC):
// only algorithms that give bit-identical results run to run (no atomics in backward filter),
// ranked by cuDNN's heuristics (the same choice every run), never by timing. -1: not yet set,
// read from REPLICA_DETERMINISTIC on first use. One setting for the process, as the backend is
// one instance for every GPU replica.
extern std::atomic<int> g_deterministic;
bool deterministic();

struct ConvKey {
  int64_t v[11];
  bool operator==(const ConvKey& o) const { return std::memcmp(v, o.v, sizeof v) == 0; }
};
struct ConvKeyHash {
  size_t operator()(const ConvKey& k) const {
    size_t h = 1469598103934665603ull;
    for (int64_t x : k.v) h = (h ^ static_cast<size_t>(x)) * 1099511628211ull;
    return h;
  }
};

// Descriptors of one convolution shape and the algorithm of each direction once chosen.
struct ConvPlan {
  cudnnTensorDescriptor_t x{}, y{};
  cudnnFilterDescriptor_t w{};
  cudnnConvolutionDescriptor_t conv[3]{};  // forward, backward data, backward filter (math types may differ)
  bool chosen[3] = {false, false, false};
  int algo[3] = {0, 0, 0};
  size_t ws[3] = {0, 0, 0};
  int fallback[3] = {-1, -1, -1};  // an algorithm that needs no workspace, for when the pool is short
  ~ConvPlan() {
    if (x) cudnnDestroyTensorDescriptor(x);
    if (y) cudnnDestroyTensorDescriptor(y);
    if (w) cudnnDestroyFilterDescriptor(w);
    for (auto c : conv)
      if (c) cudnnDestroyConvolutionDescriptor(c);
  }
};

// Per thread and device: handles, the plan cache, a small device scratch for reductions and a
// pinned host buffer for their results.
struct ThreadState {
  int device = -1;
  cudnnHandle_t cudnn{};
  cublasHandle_t cublas{};
  std::unordered_map<ConvKey, std::unique_ptr<ConvPlan>, ConvKeyHash> plans;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  void* host = nullptr;  // 4 KiB pinned
  cudaEvent_t read_done{};  // the step's one read: polled, so communicator checks run while it waits
  cudaStream_t bound = nullptr;  // the stream the handles work on (new handles: the default one)
  uint64_t epoch = 0;            // Backend::capture_epoch: bumped when the scratch moves
  // cuBLAS's workspace, one per stream the handle worked on (two streams' GEMMs may overlap on the
  // device), set explicitly: cuBLAS's own pool would allocate on first use of a stream, which
  // inside a CUDA graph capture becomes the graph's memory (train.cuda_graph), and otherwise
  // grows unseen. Outside the replica's pool, like the scratch: blas_workspace_bytes() each.
  std::unordered_map<cudaStream_t, void*> blas_ws;
  // Segment tables uploaded once (CudaBackend::upload_segments): the table, its device copy.
  static constexpr size_t kKeptSegmentTables = 16;
  std::vector<std::pair<std::vector<std::pair<int64_t, int64_t>>, int64_t*>> segment_tables;
  ~ThreadState() {
    plans.clear();
    if (cudnn) cudnnDestroy(cudnn);
    if (cublas) cublasDestroy(cublas);
    if (scratch || !blas_ws.empty() || !segment_tables.empty())
      cudaDeviceSynchronize();  // their users finish first (thread exit only)
    if (scratch) cudaFree(scratch);  // stream-ordered memory: cudaFree does not wait for its users
    for (auto& [s, w] : blas_ws) cudaFree(w);
    for (auto& [key, d] : segment_tables) cudaFree(d);
    if (host) cudaFreeHost(host);
    if (read_done) cudaEventDestroy(read_done);
  }
  // Device scratch of at least `bytes` (grows; stream-ordered reuse is safe on one stream).
  // Stream-ordered allocation (cudaMallocAsync / cudaFreeAsync, CUDA 11.2+): the old buffer is
  // freed after the work queued on this stream, so growing needs no host wait.
  void* get_scratch(size_t bytes) {
    if (bytes > scratch_bytes) {
      // Growing inside a CUDA graph capture would make the scratch a graph allocation, invalid
      // outside the graph: the capture fails instead (train.cuda_graph captures after warm-up).
      if (capturing())
        throw CudaError("the CUDA backend's scratch would grow to " + format_bytes(bytes) +
                        " inside a CUDA graph capture; the step before the capture should have grown it");
      ++epoch;
      if (scratch) REPLICA_CUDA_CHECK(cudaFreeAsync(scratch, stream()));
      scratch_bytes = std::max<size_t>(bytes, 64 << 10);
      REPLICA_CUDA_CHECK(cudaMallocAsync(&scratch, scratch_bytes, stream()));
    }
    return scratch;
  }
};

// This thread's state on its current device, its handles bound to the thread's current stream.
ThreadState& state();
// Copies `bytes` of device results to the host and waits for them (a host synchronisation).
void fetch(ThreadState& ts, const void* dev, void* out, size_t bytes);

class CudaBackend final : public Backend {
 public:
  // cuda_backend.cpp: identity, elementwise, pooling, the loss, reductions, host reads.
  std::string name() const override;
  void set_deterministic(bool on) override;
  bool deterministic() const override;
  uint64_t capture_epoch() const override;
  void relu_forward(const Tensor& x, const Tensor& y) override;
  void relu_backward(const Tensor& y, const Tensor& dy, const Tensor& dx) override;
  void add(const Tensor& a, const Tensor& b, const Tensor& y) override;
  void add_relu(const Tensor& a, const Tensor& b, const Tensor& y) override;
  void axpy(float alpha, const Tensor& x, const Tensor& y) override;
  void fill(const Tensor& y, float value) override;
  void set_values(const Tensor& dst, const float* values, int64_t n) override;
  void scale(const Tensor& y, float alpha) override;
  void scale_by(const Tensor& y, const Tensor& factor) override;
  void cast(const Tensor& src, const Tensor& dst) override;
  void rsqrt_eps(const Tensor& x, const Tensor& y, float eps) override;
  void maxpool_forward(const Tensor& x, const Tensor& y, const Tensor& argmax, const PoolGeom& g) override;
  void maxpool_backward(const Tensor& dy, const Tensor& argmax, const Tensor& dx, const PoolGeom& g) override;
  void global_avgpool_forward(const Tensor& x, const Tensor& y) override;
  void global_avgpool_backward(const Tensor& dy, const Tensor& dx) override;
  LossResult softmax_xent_forward(const Tensor& logits, const Tensor& labels, const Tensor& probs) override;
  void softmax_xent_accumulate(const Tensor& logits, const Tensor& labels, const Tensor& probs,
                               const Tensor& sums, float smoothing) override;
  void softmax_xent_backward(const Tensor& probs, const Tensor& labels, const StepScalar& scale,
                             const Tensor& dlogits, float smoothing) override;
  double sum_squares(const Tensor& x) override;
  std::vector<double> segment_sum_squares(const Tensor& x,
                                          const std::vector<std::pair<int64_t, int64_t>>& segments) override;
  bool unscale_check_finite(const Tensor& grads, float inv_scale) override;
  void sum_squares_into(const Tensor& x, const Tensor& out) override;
  void segment_sum_squares_into(const Tensor& x, const std::vector<std::pair<int64_t, int64_t>>& segments,
                                const Tensor& out) override;
  void sum_in_order_into(const Tensor& x, const Tensor& out) override;
  void unscale_check_finite_into(const Tensor& grads, const StepScalar& inv_scale, const Tensor& nonfinite) override;
  void read_to_host(const Tensor& src, void* dst, const std::function<void()>& poll) override;

  // cudnn_conv.cpp
  void conv2d_forward(const Tensor& x_in, const Tensor& w, const Tensor& y, const ConvGeom& g,
                      MemoryPool& ws) override;
  void conv2d_backward_data(const Tensor& dy, const Tensor& w, const Tensor& dx, const ConvGeom& g,
                            MemoryPool& ws, bool accumulate) override;
  void conv2d_backward_filter(const Tensor& x_in, const Tensor& dy, const Tensor& dw, const ConvGeom& g,
                              MemoryPool& ws) override;

  // cuda_batch_norm.cpp
  void batchnorm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y,
                               const Tensor& save_mean, const Tensor& save_invstd, const Tensor& running_mean,
                               const Tensor& running_var, float momentum, float eps, const AllReduceFn& allreduce,
                               const Tensor& residual, bool relu) override;
  void batchnorm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y,
                              const Tensor& running_mean, const Tensor& running_var, float eps, const Tensor& residual,
                              bool relu) override;
  void batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                          const Tensor& save_invstd, const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta,
                          const AllReduceFn& allreduce, const Tensor& relu_y) override;
  void batchnorm_backward_frozen(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                 const Tensor& invstd, const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta,
                                 const Tensor& relu_y) override;

  // cublas_linear.cpp
  void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y) override;
  void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                       const Tensor& db) override;

  // cuda_optimizers.cpp
  void sgd_update(const Tensor& p, const Tensor& g, const Tensor& buf, const SgdUpdate& u,
                  const ChunkClasses& classes, const Tensor& copy) override;
  void adamw_update(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const AdamWUpdate& u,
                    const ChunkClasses& classes, const Tensor& copy) override;
  void lars_trust_ratios(const Tensor& params, const Tensor& grads,
                         const std::vector<std::pair<int64_t, int64_t>>& segments, float trust, float wd, float eps,
                         const Tensor& ratios) override;
  void lars_update(const Tensor& p, const Tensor& g, const Tensor& buf, const StepScalar& lr, const Tensor& ratios,
                   float momentum, float wd, const ChunkClasses& classes, const Tensor& copy,
                   const Tensor& gate) override;
  void step_gate(const Tensor& stats, const StepGateAt& at, double max_norm) override;

 private:
  struct SegmentTable {
    const int64_t* table;
    void* extra;
  };
  SegmentTable upload_segments(const std::vector<std::pair<int64_t, int64_t>>& segments, const Tensor& x,
                               const char* who, size_t extra);
  static std::vector<int64_t> flatten(const std::vector<std::pair<int64_t, int64_t>>& segments);
  const int64_t* kept_table(const std::vector<std::pair<int64_t, int64_t>>& segments);
  static double* launch_xent(ThreadState& ts, const Tensor& logits, const Tensor& labels, const Tensor& probs,
                             float smoothing);
  static Tensor as_dtype(const Tensor& t, DType dt, MemoryPool& ws);
  static void check_conv(const Tensor& a, const Tensor& b, const Tensor& c, const char* who);
  static cuk::DPtr residual_of(const Tensor& x, const Tensor& residual);
  static int channels(const Tensor& x);
  static void reduce(double* acc, float* f, int n, const AllReduceFn& allreduce, cudaStream_t s);
  static void check_linear(const Tensor& x, const Tensor& w, int I, int O);
  static void gemm(ThreadState& ts, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const Tensor& A,
                   int lda, const Tensor& B, int ldb, float beta, const Tensor& C, int ldc);
};

}  // namespace replica::ops::cuda_impl
