// The CUDA op backend's dispatch: the per-thread state, and the ops that are a check and a
// launcher of the kernel files (elementwise, pooling, the loss, reductions) or a host read.
// Convolutions (cuDNN), batch norm, linear layers (cuBLAS) and optimizers have files of their own
// (cuda_backend_impl.h says which). One instance serves every GPU replica: cuDNN/cuBLAS handles,
// algorithm caches and the small reduction scratch are per thread and device, and work goes to
// the thread's current stream (the replica's compute stream).
#include <chrono>
#include <cstdlib>
#include <thread>

#include "core/log.h"
#include "ops/cuda/cuda_backend.h"
#include "ops/cuda/cuda_backend_impl.h"

namespace replica::ops::cuda_impl {

namespace {

// cuBLAS's recommended workspace: 32 MiB on Hopper and later, 4 MiB before (cuBLAS's guide,
// "cublasSetWorkspace").
size_t blas_workspace_bytes(int device) {
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) major = 0;
  return size_t(major >= 9 ? 32 : 4) << 20;
}

}  // namespace

std::atomic<int> g_deterministic{-1};
bool deterministic() {
  int v = g_deterministic.load(std::memory_order_relaxed);
  if (v < 0) {
    v = env_flag("REPLICA_DETERMINISTIC") ? 1 : 0;
    g_deterministic.store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

ThreadState& state() {
  thread_local std::unordered_map<int, std::unique_ptr<ThreadState>> states;
  int dev = 0;
  REPLICA_CUDA_CHECK(cudaGetDevice(&dev));
  auto& st = states[dev];
  if (!st) {
    st = std::make_unique<ThreadState>();
    st->device = dev;
    REPLICA_CUDNN_CHECK(cudnnCreate(&st->cudnn));
    REPLICA_CUBLAS_CHECK(cublasCreate(&st->cublas));
    REPLICA_CUDA_CHECK(cudaMallocHost(&st->host, 4096));
    REPLICA_CUDA_CHECK(cudaEventCreateWithFlags(&st->read_done, cudaEventDisableTiming));
  }
  // Handles start on the default stream; rebinding happens once per stream change, not per op.
  if (cudaStream_t s = stream(); s != st->bound) {
    REPLICA_CUDNN_CHECK(cudnnSetStream(st->cudnn, s));
    // cublasSetStream puts the handle back on cuBLAS's own workspace pool: the stream's own
    // workspace is set again after it, every time.
    REPLICA_CUBLAS_CHECK(cublasSetStream(st->cublas, s));
    void*& ws = st->blas_ws[s];
    if (!ws) REPLICA_CUDA_CHECK(cudaMalloc(&ws, blas_workspace_bytes(dev)));
    REPLICA_CUBLAS_CHECK(cublasSetWorkspace(st->cublas, ws, blas_workspace_bytes(dev)));
    st->bound = s;
  }
  return *st;
}

void fetch(ThreadState& ts, const void* dev, void* out, size_t bytes) {
  note_host_sync();
  REPLICA_CUDA_CHECK(cudaMemcpyAsync(ts.host, dev, bytes, cudaMemcpyDeviceToHost, stream()));
  REPLICA_CUDA_CHECK(cudaStreamSynchronize(stream()));
  std::memcpy(out, ts.host, bytes);
}

std::string CudaBackend::name() const {
  return "cuda (cuDNN " + std::to_string(cudnnGetVersion()) + ", cuBLAS)";
}

void CudaBackend::set_deterministic(bool on) { g_deterministic.store(on ? 1 : 0); }

bool CudaBackend::deterministic() const { return cuda_impl::deterministic(); }

uint64_t CudaBackend::capture_epoch() const { return state().epoch; }

void CudaBackend::relu_forward(const Tensor& x, const Tensor& y) {
  require_same(x, y, "relu_forward");
  cuk::relu_forward(dp(x), dp(y), x.numel(), stream());
}

void CudaBackend::relu_backward(const Tensor& y, const Tensor& dy, const Tensor& dx) {
  require_same(y, dy, "relu_backward");
  cuk::relu_backward(dp(y), dp(dy), dp(dx), y.numel(), stream());
}

void CudaBackend::add(const Tensor& a, const Tensor& b, const Tensor& y) {
  require_same(a, b, "add");
  require_same(a, y, "add");
  cuk::add(dp(a), dp(b), dp(y), a.numel(), stream());
}

void CudaBackend::add_relu(const Tensor& a, const Tensor& b, const Tensor& y) {
  require_same(a, b, "add_relu");
  require_same(a, y, "add_relu");
  cuk::add_relu(dp(a), dp(b), dp(y), a.numel(), stream());
}

void CudaBackend::axpy(float alpha, const Tensor& x, const Tensor& y) {
  require_same(x, y, "axpy");
  cuk::axpy(alpha, dp(x), dp(y), x.numel(), stream());
}

void CudaBackend::fill(const Tensor& y, float value) {
  require_float(y, "fill");
  cuk::fill(dp(y), value, y.numel(), stream());
}

void CudaBackend::set_values(const Tensor& dst, const float* values, int64_t n) {
  if (dst.dtype() != DType::f32 || n < 0 || n > kMaxSetValues || dst.numel() < n)
    throw ShapeError("set_values: " + std::to_string(n) + " values do not fit " + dst.str() + " (f32, at most " +
                     std::to_string(kMaxSetValues) + ")");
  cuk::set_values(dst.data<float>(), values, static_cast<int>(n), stream());
}

void CudaBackend::scale(const Tensor& y, float alpha) { cuk::scale(dp(y), alpha, y.numel(), stream()); }

void CudaBackend::scale_by(const Tensor& y, const Tensor& factor) {
  require_f32(y, "scale_by");
  check_factor(factor, y, "scale_by");
  cuk::scale_by(y.data<float>(), y.numel(), factor.data<float>(), stream());
}

void CudaBackend::maxpool_forward(const Tensor& x, const Tensor& y, const Tensor& argmax, const PoolGeom& g) {
  cuk::maxpool_forward(dp(x), dp(y), argmax.data<int32_t>(), as_int(g.N, "maxpool"), as_int(g.H, "maxpool"),
                       as_int(g.W, "maxpool"), as_int(g.C, "maxpool"), as_int(g.P, "maxpool"), as_int(g.Q, "maxpool"),
                       static_cast<int>(g.window), static_cast<int>(g.stride), static_cast<int>(g.pad), stream());
}

void CudaBackend::maxpool_backward(const Tensor& dy, const Tensor& argmax, const Tensor& dx, const PoolGeom& g) {
  cuk::maxpool_backward(dp(dy), argmax.data<int32_t>(), dp(dx), as_int(g.N, "maxpool"), as_int(g.H, "maxpool"),
                        as_int(g.W, "maxpool"), as_int(g.C, "maxpool"), as_int(g.P, "maxpool"),
                        as_int(g.Q, "maxpool"), static_cast<int>(g.window), static_cast<int>(g.stride),
                        static_cast<int>(g.pad), stream());
}

void CudaBackend::global_avgpool_forward(const Tensor& x, const Tensor& y) {
  cuk::global_avgpool_forward(dp(x), dp(y), as_int(x.dim(0), "avgpool"), as_int(x.dim(1) * x.dim(2), "avgpool"),
                              as_int(x.dim(3), "avgpool"), stream());
}

void CudaBackend::global_avgpool_backward(const Tensor& dy, const Tensor& dx) {
  cuk::global_avgpool_backward(dp(dy), dp(dx), as_int(dx.dim(0), "avgpool"), as_int(dx.dim(1) * dx.dim(2), "avgpool"),
                               as_int(dx.dim(3), "avgpool"), stream());
}

Backend::LossResult CudaBackend::softmax_xent_forward(const Tensor& logits, const Tensor& labels, const Tensor& probs) {
  auto& ts = state();
  const int K = as_int(logits.dim(1), "softmax_cross_entropy");
  double* result = launch_xent(ts, logits, labels, probs, 0.f);
  char host[sizeof(double) + 3 * sizeof(int)];
  fetch(ts, result, host, sizeof host);
  double loss;
  int c[3];  // correct, the first bad row + 1, top-5 correct
  std::memcpy(&loss, host, sizeof loss);
  std::memcpy(c, host + sizeof loss, sizeof c);
  if (c[1]) {
    int32_t bad = 0;
    const int64_t row = c[1] - 1, stride = labels.shape().rank() == 2 ? 2 : 1;
    fetch(ts, labels.data<int32_t>() + row * stride, &bad, sizeof bad);
    throw ShapeError("softmax_cross_entropy: label " + std::to_string(bad) + " of sample " + std::to_string(row) +
                     " is outside [0, " + std::to_string(K) + ")" +
                     (stride == 2 ? " (or its pair's label, or its mixing weight, is out of range)" : ""));
  }
  return {loss, c[0], c[2]};
}

void CudaBackend::softmax_xent_accumulate(const Tensor& logits, const Tensor& labels, const Tensor& probs,
                                          const Tensor& sums, float smoothing) {
  if (sums.dtype() != DType::f32 || sums.numel() < 3)
    throw ShapeError("softmax_xent_accumulate: sums must be f32 with 3 elements, got " + sums.str());
  auto& ts = state();
  double* result = launch_xent(ts, logits, labels, probs, smoothing);
  cuk::xent_fold(result, reinterpret_cast<int*>(result + 1), sums.data<float>(), stream());
}

void CudaBackend::softmax_xent_backward(const Tensor& probs, const Tensor& labels, const StepScalar& scale,
                                        const Tensor& dlogits, float smoothing) {
  const bool mixed = MixedLabels::check(labels, probs.dim(0));
  cuk::softmax_xent_backward(dp(probs), labels.data<int32_t>(), mixed, knob(scale, dlogits, "softmax_xent_backward"),
                             smoothing, dp(dlogits), as_int(probs.dim(0), "xent"), as_int(probs.dim(1), "xent"),
                             stream());
}

void CudaBackend::cast(const Tensor& src, const Tensor& dst) {
  require_same(src, dst, "cast");
  require_float(src, "cast");
  require_float(dst, "cast");
  cuk::cast(dp(src), dp(dst), src.numel(), stream());
}

CudaBackend::SegmentTable CudaBackend::upload_segments(const std::vector<std::pair<int64_t, int64_t>>& segments, const Tensor& x,
                             const char* who, size_t extra) {
  for (const auto& [off, cnt] : segments)
    if (off < 0 || off + cnt > x.numel()) throw ShapeError(std::string(who) + ": segment past the end of " + x.str());
  auto& ts = state();
  if (const int64_t* kept = kept_table(segments)) return {kept, extra ? ts.get_scratch(extra) : nullptr};
  // A copy from this call's host vector would sit in a captured graph and read freed memory at
  // every replay: a table first seen inside a capture fails it (train.cuda_graph then runs eagerly).
  if (capturing())
    throw CudaError(std::string(who) + ": a segment table not kept before the CUDA graph capture (" +
                    std::to_string(segments.size()) + " segments); the eager steps before it keep the step's tables");
  const std::vector<int64_t> oc = flatten(segments);
  const size_t bytes = oc.size() * sizeof(int64_t);
  auto* d = static_cast<char*>(ts.get_scratch(bytes + extra));
  REPLICA_CUDA_CHECK(cudaMemcpyAsync(d, oc.data(), bytes, cudaMemcpyHostToDevice, stream()));
  return {reinterpret_cast<int64_t*>(d), d + bytes};
}

// [offsets..., counts...]
std::vector<int64_t> CudaBackend::flatten(const std::vector<std::pair<int64_t, int64_t>>& segments) {
  const size_t n = segments.size();
  std::vector<int64_t> oc(2 * n);
  for (size_t i = 0; i < n; ++i) {
    oc[i] = segments[i].first;
    oc[n + i] = segments[i].second;
  }
  return oc;
}

// The device copy of a table kept for this thread (uploaded now if it is new), or null when it
// cannot be kept (kKeptSegmentTables reached, or inside a capture): the caller stages it.
const int64_t* CudaBackend::kept_table(const std::vector<std::pair<int64_t, int64_t>>& segments) {
  auto& ts = state();
  for (const auto& t : ts.segment_tables)
    if (t.first == segments) return t.second;
  if (ts.segment_tables.size() >= ThreadState::kKeptSegmentTables || capturing()) return nullptr;
  const std::vector<int64_t> oc = flatten(segments);
  const size_t bytes = std::max<size_t>(1, oc.size()) * sizeof(int64_t);
  int64_t* d = nullptr;
  REPLICA_CUDA_CHECK(cudaMalloc(&d, bytes));
  ts.segment_tables.emplace_back(segments, d);  // owned from here: freed with the thread's state
  // Complete before it is used from any stream: once per table, one wait for this stream (a
  // set-up wait of the first step, like cuDNN's algorithm search, not a step's host sync).
  if (!oc.empty()) REPLICA_CUDA_CHECK(cudaMemcpyAsync(d, oc.data(), oc.size() * sizeof(int64_t),
                                                      cudaMemcpyHostToDevice, stream()));
  REPLICA_CUDA_CHECK(cudaStreamSynchronize(stream()));
  return d;
}

double CudaBackend::sum_squares(const Tensor& x) {
  require_f32(x, "sum_squares");
  auto& ts = state();
  double* out = static_cast<double*>(ts.get_scratch((1 + cuk::kReduceBlocks) * sizeof(double)));
  cuk::sum_squares(x.data<float>(), x.numel(), out, out + 1, stream());
  double r = 0;
  fetch(ts, out, &r, sizeof r);
  return r;
}

std::vector<double> CudaBackend::segment_sum_squares(const Tensor& x,
                                        const std::vector<std::pair<int64_t, int64_t>>& segments) {
  require_f32(x, "segment_sum_squares");
  const int n = static_cast<int>(segments.size());
  std::vector<double> out(segments.size());
  if (n == 0) return out;
  cudaStream_t s = stream();
  const SegmentTable t = upload_segments(segments, x, "segment_sum_squares", out.size() * sizeof(double));
  const int64_t* d = t.table;
  double* res = static_cast<double*>(t.extra);
  cuk::segment_sum_squares(x.data<float>(), d, d + n, n, res, s);
  note_host_sync();
  REPLICA_CUDA_CHECK(cudaMemcpyAsync(out.data(), res, out.size() * sizeof(double), cudaMemcpyDeviceToHost, s));
  REPLICA_CUDA_CHECK(cudaStreamSynchronize(s));
  return out;
}

bool CudaBackend::unscale_check_finite(const Tensor& grads, float inv_scale) {
  require_f32(grads, "unscale_check_finite");
  auto& ts = state();
  int* flag = static_cast<int*>(ts.get_scratch(sizeof(int)));
  REPLICA_CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int), stream()));
  cuk::unscale_check(grads.data<float>(), grads.numel(), cuk::Knob{inv_scale, nullptr}, flag, stream());
  int bad = 0;
  fetch(ts, flag, &bad, sizeof bad);
  return bad == 0;
}

void CudaBackend::sum_squares_into(const Tensor& x, const Tensor& out) {
  require_f32(x, "sum_squares");
  require_f32(out, "sum_squares (output)");
  auto& ts = state();
  double* acc = static_cast<double*>(ts.get_scratch((1 + cuk::kReduceBlocks) * sizeof(double)));
  cuk::sum_squares(x.data<float>(), x.numel(), acc, acc + 1, stream());
  cuk::doubles_to_floats(acc, out.data<float>(), 1, stream());
}

void CudaBackend::segment_sum_squares_into(const Tensor& x, const std::vector<std::pair<int64_t, int64_t>>& segments,
                              const Tensor& out) {
  require_f32(x, "segment_sum_squares_into");
  require_f32(out, "segment_sum_squares_into (output)");
  const int n = static_cast<int>(segments.size());
  if (out.numel() < n) throw ShapeError("segment_sum_squares_into: " + out.str() + " holds too few sums");
  if (n == 0) return;
  cudaStream_t s = stream();
  const SegmentTable t = upload_segments(segments, x, "segment_sum_squares_into", n * sizeof(double));
  const int64_t* d = t.table;
  double* res = static_cast<double*>(t.extra);
  cuk::segment_sum_squares(x.data<float>(), d, d + n, n, res, s);
  cuk::doubles_to_floats(res, out.data<float>(), n, s);
}

void CudaBackend::sum_in_order_into(const Tensor& x, const Tensor& out) {
  require_f32(x, "sum_in_order_into");
  require_f32(out, "sum_in_order_into (output)");
  cuk::sum_in_order(x.data<float>(), x.numel(), out.data<float>(), stream());
}

void CudaBackend::unscale_check_finite_into(const Tensor& grads, const StepScalar& inv_scale, const Tensor& nonfinite) {
  require_f32(grads, "unscale_check_finite");
  require_f32(nonfinite, "unscale_check_finite (flag)");
  cuk::unscale_check(grads.data<float>(), grads.numel(), knob(inv_scale, grads, "unscale_check_finite_into"),
                     nonfinite.data<float>(), stream());
}

void CudaBackend::read_to_host(const Tensor& src, void* dst, const std::function<void()>& poll) {
  const size_t bytes = src.nbytes();
  if (bytes > 4096) throw ShapeError("read_to_host: " + src.str() + " is larger than the 4 KiB staging buffer");
  auto& ts = state();
  cudaStream_t s = stream();
  note_host_sync();
  REPLICA_CUDA_CHECK(cudaMemcpyAsync(ts.host, src.raw(), bytes, cudaMemcpyDeviceToHost, s));
  REPLICA_CUDA_CHECK(cudaEventRecord(ts.read_done, s));
  // Poll rather than block in cudaEventSynchronize: the stream may be waiting on a collective,
  // and `poll` is what notices that collective failing or hanging.
  for (int spin = 0;; ++spin) {
    const cudaError_t q = cudaEventQuery(ts.read_done);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) REPLICA_CUDA_CHECK(q);
    if (spin > 64) {
      if (poll) poll();
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  std::memcpy(dst, ts.host, bytes);
}

void CudaBackend::rsqrt_eps(const Tensor& x, const Tensor& y, float eps) {
  require_f32(x, "rsqrt_eps");
  require_f32(y, "rsqrt_eps");
  cuk::rsqrt_eps(x.data<float>(), y.data<float>(), eps, x.numel(), stream());
}

// The loss kernel into the thread's scratch: [loss sum (double) | correct, first bad row + 1 (int)].
double* CudaBackend::launch_xent(ThreadState& ts, const Tensor& logits, const Tensor& labels, const Tensor& probs,
                                 float smoothing) {
  const int N = as_int(logits.dim(0), "softmax_cross_entropy"), K = as_int(logits.dim(1), "softmax_cross_entropy");
  const bool mixed = MixedLabels::check(labels, N);
  cudaStream_t s = stream();
  // scratch: result (double) | counts (3 ints: correct, first bad row + 1, top-5 correct; two
  // doubles' room) | each row's loss (N doubles)
  double* result = static_cast<double*>(ts.get_scratch((3 + static_cast<size_t>(N)) * sizeof(double)));
  int* counts = reinterpret_cast<int*>(result + 1);
  REPLICA_CUDA_CHECK(cudaMemsetAsync(counts, 0, 3 * sizeof(int), s));
  cuk::softmax_xent_forward(dp(logits), labels.data<int32_t>(), mixed, dp(probs), N, K, smoothing, result + 3, result,
                            counts, s);
  return result;
}

}  // namespace replica::ops::cuda_impl

namespace replica::ops {

Backend& cuda_backend() {
  static cuda_impl::CudaBackend backend;
  return backend;
}

std::string cuda_library_versions() {
  // cudnnGetVersion is the library that was loaded, CUDNN_VERSION the header it was built with.
  const size_t v = cudnnGetVersion();
  std::string out = "cuDNN " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
                    std::to_string(v % 100) + " (built with " + std::to_string(CUDNN_MAJOR) + "." +
                    std::to_string(CUDNN_MINOR) + "." + std::to_string(CUDNN_PATCHLEVEL) + ")";
  int cublas = 0;
  if (cublasGetProperty(MAJOR_VERSION, &cublas) == CUBLAS_STATUS_SUCCESS) {
    int minor = 0, patch = 0;
    cublasGetProperty(MINOR_VERSION, &minor);
    cublasGetProperty(PATCH_LEVEL, &patch);
    out += ", cuBLAS " + std::to_string(cublas) + "." + std::to_string(minor) + "." + std::to_string(patch);
  }
  return out;
}

}  // namespace replica::ops
