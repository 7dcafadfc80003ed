// The CUDA op backend: cuDNN for convolutions (NHWC; the algorithm is chosen once per shape and
// cached, like cudnn.benchmark; workspaces come from the replica's pool, tag workspace), cuBLAS
// GEMMs for linear layers, and the kernels of kernels.cu for the rest. One instance serves every
// GPU replica: cuDNN/cuBLAS handles, algorithm caches and the small reduction scratch are per
// thread and device, and work goes to the thread's current stream (the replica's compute stream).
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>

#include "core/cuda/check.h"
#include "core/env.h"
#include "core/errors.h"
#include "core/log.h"
#include "core/stream.h"
#include "ops/cuda/cuda_backend.h"
#include "ops/cuda/kernels.h"

namespace replica::ops {
namespace {

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

cuk::DPtr dp(const Tensor& t) { return {t.raw(), static_cast<int>(t.dtype())}; }
// Scratch regions start on 256-byte boundaries (what cudaMalloc guarantees for the first).
size_t align_up(size_t bytes) { return (bytes + 255) & ~size_t(255); }

void require_float(const Tensor& t, const char* who) {
  if (t.dtype() != DType::f32 && t.dtype() != DType::f16 && t.dtype() != DType::bf16)
    throw ShapeError(std::string(who) + ": expected f32, f16 or bf16, got " + t.str());
}
void require_f32(const Tensor& t, const char* who) {
  if (t.dtype() != DType::f32) throw ShapeError(std::string(who) + ": expected f32, got " + t.str());
}
void require_same(const Tensor& a, const Tensor& b, const char* who) {
  if (a.numel() != b.numel()) throw ShapeError(std::string(who) + ": " + a.str() + " and " + b.str() + " differ in size");
}
// The optimizer updates' 16-bit copy (Backend::sgd_update), checked: none, or f16 / bf16 of p's size.
cuk::DPtr copy_ptr(const Tensor& copy, const Tensor& p, const char* who) {
  check_copy(copy, p, who);
  return copy.defined() ? dp(copy) : cuk::DPtr{};
}
// A StepScalar as the kernels take it, checked (ShapeError naming `who`).
cuk::Knob knob(const StepScalar& s, const Tensor& y, const char* who) {
  check_step_scalar(s, y, who);
  return {s.value, s.at.defined() ? s.at.data<float>() : nullptr};
}
// The update's gate (null when there is none).
const float* gate_ptr(const Tensor& gate) { return gate.defined() ? gate.data<float>() : nullptr; }
// The group table's entries (null when there is none).
static_assert(ops::kParamChunk == (1 << cuk::kChunkShift), "the kernels' chunk is the flat buffer's");
template <typename T>
const T* table(const ChunkClasses& c) {
  return c.table.defined() ? c.table.data<T>() : nullptr;
}
int as_int(int64_t v, const char* who) {
  if (v > 0x7fffffff) throw ShapeError(std::string(who) + ": dimension " + std::to_string(v) + " exceeds 2^31");
  return static_cast<int>(v);
}

cudaStream_t stream() {
  Stream* s = current_stream();
  return s ? static_cast<cudaStream_t>(s->native()) : nullptr;
}

// TF32 for f32 convolutions and GEMMs (PyTorch's default for cuDNN convolutions) only when asked:
// f32 runs are the ones compared against the CPU backend.
bool allow_tf32() { return env_flag("REPLICA_ALLOW_TF32"); }
// cuDNN's math type per storage dtype, chosen deliberately (cuDNN 9's cudnnMathType_t):
//  - f16 / bf16: CUDNN_TENSOR_OP_MATH (tensor cores; accumulation stays f32 by the descriptor);
//  - f32 with TF32 allowed: CUDNN_DEFAULT_MATH, which on Ampere and later lets cuDNN use TF32
//    tensor cores for f32 data (what PyTorch does with allow_tf32). Not ..._ALLOW_CONVERSION:
//    that one may also down-convert f32 tensors to f16 / bf16, which nobody asked for;
//  - f32 without TF32: CUDNN_FMA_MATH, true f32 arithmetic (what the CPU backend is held to).
cudnnMathType_t conv_math_type(DType dt, bool tf32) {
  if (dt != DType::f32) return CUDNN_TENSOR_OP_MATH;
  return tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
}
// Deterministic mode (Backend::set_deterministic; train.deterministic, REPLICA_DETERMINISTIC):
// only algorithms that give bit-identical results run to run (no atomics in backward filter),
// ranked by cuDNN's heuristics (the same choice every run), never by timing. -1: not yet set,
// read from REPLICA_DETERMINISTIC on first use. One setting for the process, as the backend is
// one instance for every GPU replica.
std::atomic<int> g_deterministic{-1};
bool deterministic() {
  int v = g_deterministic.load(std::memory_order_relaxed);
  if (v < 0) {
    v = env_flag("REPLICA_DETERMINISTIC") ? 1 : 0;
    g_deterministic.store(v, std::memory_order_relaxed);
  }
  return v == 1;
}
// "find" (default): time every algorithm once per shape, like cudnn.benchmark; "heuristic":
// cuDNN's ranking without timing (instant, sometimes slower).
bool use_find() {
  const char* v = std::getenv("REPLICA_CUDNN_ALGO");
  if (!v || !*v || std::strcmp(v, "find") == 0) return true;
  if (std::strcmp(v, "heuristic") == 0) return false;
  throw ConfigError(std::string("REPLICA_CUDNN_ALGO=") + v + ": expected find or heuristic");
}
size_t workspace_cap() {
  const char* v = std::getenv("REPLICA_CUDNN_WORKSPACE_MB");
  if (!v || !*v) return size_t(1) << 30;
  char* end = nullptr;
  const long mb = std::strtol(v, &end, 10);
  if (*end || mb < 0)
    throw ConfigError(std::string("REPLICA_CUDNN_WORKSPACE_MB=") + v + ": expected a whole number of MiB");
  return static_cast<size_t>(mb) << 20;
}

cudnnDataType_t cudnn_type(DType t) {
  switch (t) {
    case DType::f16: return CUDNN_DATA_HALF;
    case DType::bf16: return CUDNN_DATA_BFLOAT16;
    default: return CUDNN_DATA_FLOAT;
  }
}
cudaDataType_t blas_type(DType t) {
  switch (t) {
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

struct ConvKey {
  int64_t v[10];
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
      cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
      REPLICA_CUDA_CHECK(cudaStreamIsCapturing(stream(), &cs));
      if (cs != cudaStreamCaptureStatusNone)
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

// cuBLAS's recommended workspace: 32 MiB on Hopper and later, 4 MiB before (cuBLAS's guide,
// "cublasSetWorkspace").
size_t blas_workspace_bytes(int device) {
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) major = 0;
  return size_t(major >= 9 ? 32 : 4) << 20;
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

// Copies `bytes` of device results to the host and waits for them (a host synchronisation).
void fetch(ThreadState& ts, const void* dev, void* out, size_t bytes) {
  note_host_sync();
  REPLICA_CUDA_CHECK(cudaMemcpyAsync(ts.host, dev, bytes, cudaMemcpyDeviceToHost, stream()));
  REPLICA_CUDA_CHECK(cudaStreamSynchronize(stream()));
  std::memcpy(out, ts.host, bytes);
}

std::string geom_str(const ConvGeom& g) {
  return "conv " + std::to_string(g.R) + "x" + std::to_string(g.S) + " stride " + std::to_string(g.stride) + " pad " +
         std::to_string(g.pad) + " on [" + std::to_string(g.N) + "," + std::to_string(g.H) + "," + std::to_string(g.W) +
         "," + std::to_string(g.C) + "] -> " + std::to_string(g.K) + " channels";
}

ConvPlan& plan_for(ThreadState& ts, const ConvGeom& g, DType dt) {
  // Deterministic mode chooses among fewer algorithms in another way: plans of either mode apart.
  ConvKey key{{g.N, g.H, g.W, g.C, g.K, g.R, g.S, g.stride, g.pad, static_cast<int64_t>(dt) | (deterministic() ? 256 : 0)}};
  auto& p = ts.plans[key];
  if (p) return *p;
  p = std::make_unique<ConvPlan>();
  const cudnnDataType_t t = cudnn_type(dt);
  REPLICA_CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->x));
  REPLICA_CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->y));
  REPLICA_CUDNN_CHECK(cudnnCreateFilterDescriptor(&p->w));
  REPLICA_CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->x, CUDNN_TENSOR_NHWC, t, as_int(g.N, "conv"), as_int(g.C, "conv"),
                                                 as_int(g.H, "conv"), as_int(g.W, "conv")));
  REPLICA_CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->y, CUDNN_TENSOR_NHWC, t, as_int(g.N, "conv"), as_int(g.K, "conv"),
                                                 as_int(g.P, "conv"), as_int(g.Q, "conv")));
  REPLICA_CUDNN_CHECK(cudnnSetFilter4dDescriptor(p->w, t, CUDNN_TENSOR_NHWC, as_int(g.K, "conv"), as_int(g.C, "conv"),
                                                 as_int(g.R, "conv"), as_int(g.S, "conv")));
  const cudnnMathType_t math = conv_math_type(dt, allow_tf32());
  for (auto& c : p->conv) {
    REPLICA_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&c));
    // Cross-correlation, as PyTorch and the CPU backend; accumulation in f32 for every storage type.
    REPLICA_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(c, as_int(g.pad, "conv"), as_int(g.pad, "conv"),
                                                        as_int(g.stride, "conv"), as_int(g.stride, "conv"), 1, 1,
                                                        CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    REPLICA_CUDNN_CHECK(cudnnSetConvolutionMathType(c, math));
  }
  return *p;
}

// Workspace for timing the algorithms: as much of `cap` as the pool will give.
Tensor find_workspace(MemoryPool& pool, size_t cap) {
  for (size_t b = cap; b >= (size_t(16) << 20); b /= 2) {
    try {
      return Tensor::empty(pool, {static_cast<int64_t>(b)}, DType::u8, MemTag::workspace);
    } catch (const OutOfMemoryError&) {
    }
  }
  return Tensor();
}

// Takes the fastest usable result (cuDNN sorts them) and one that needs no workspace.
template <typename Perf>
void pick(ConvPlan& p, int dir, const Perf* perf, int n, size_t cap, const ConvGeom& g, const char* what) {
  const bool det = deterministic();
  for (int i = 0; i < n; ++i) {
    const Perf& r = perf[i];
    if (r.status != CUDNN_STATUS_SUCCESS || (det && r.determinism != CUDNN_DETERMINISTIC)) continue;
    if (r.memory == 0 && p.fallback[dir] < 0) p.fallback[dir] = static_cast<int>(r.algo);
    if (!p.chosen[dir] && r.memory <= cap) {
      p.chosen[dir] = true;
      p.algo[dir] = static_cast<int>(r.algo);
      p.ws[dir] = r.memory;
      REPLICA_CUDNN_CHECK(cudnnSetConvolutionMathType(p.conv[dir], r.mathType));
    }
  }
  if (!p.chosen[dir])
    throw CudaError(std::string("cuDNN has no usable ") + what + " algorithm for " + geom_str(g) +
                    (det ? " in deterministic mode (train.deterministic)" : "") + " within a workspace of " + format_bytes(cap) +
                    "; raise REPLICA_CUDNN_WORKSPACE_MB");
}

// Chooses direction `dir`'s algorithm once: `find(perf, &n, workspace, bytes)` times them all
// (cudnnFind*Ex), `heuristic(perf, &n)` asks cuDNN's ranking (cudnnGet*_v7).
template <typename Perf, int Count, typename Find, typename Heuristic>
void choose(ConvPlan& p, int dir, MemoryPool& pool, const ConvGeom& g, const char* what, Find&& find,
            Heuristic&& heuristic) {
  if (p.chosen[dir]) return;
  Perf perf[Count];
  int n = 0;
  size_t cap = workspace_cap();
  if (use_find() && !deterministic()) {
    Tensor ws = find_workspace(pool, cap);
    cap = ws.defined() ? ws.nbytes() : 0;
    find(perf, &n, ws.defined() ? ws.raw() : nullptr, cap);
  } else {
    heuristic(perf, &n);
  }
  pick(p, dir, perf, n, cap, g, what);
}

// Runs `call(algo, ws_ptr, ws_bytes)` with the chosen algorithm and a pool workspace, or with the
// no-workspace fallback when the pool cannot give the workspace.
template <typename Call>
void run_conv(ConvPlan& p, int dir, MemoryPool& pool, const ConvGeom& g, Call&& call) {
  Tensor ws;
  int algo = p.algo[dir];
  if (p.ws[dir]) {
    try {
      ws = Tensor::empty(pool, {static_cast<int64_t>(p.ws[dir])}, DType::u8, MemTag::workspace);
    } catch (const OutOfMemoryError&) {
      if (p.fallback[dir] < 0) throw;
      log_warn("cuDNN: no room for a ", format_bytes(p.ws[dir]), " workspace for ", geom_str(g),
               "; using an algorithm without one (slower)");
      algo = p.fallback[dir];
      p.algo[dir] = algo;
      p.ws[dir] = 0;
    }
  }
  call(algo, ws.defined() ? ws.raw() : nullptr, ws.defined() ? p.ws[dir] : size_t(0));
}

class CudaBackend final : public Backend {
 public:
  std::string name() const override {
    return "cuda (cuDNN " + std::to_string(cudnnGetVersion()) + ", cuBLAS)";
  }
  void set_deterministic(bool on) override { g_deterministic.store(on ? 1 : 0); }
  bool deterministic() const override { return ops::deterministic(); }
  uint64_t capture_epoch() const override { return state().epoch; }

  void conv2d_forward(const Tensor& x_in, const Tensor& w, const Tensor& y, const ConvGeom& g,
                      MemoryPool& ws) override {
    // f32 images into a 16-bit model (the stem): rounded to the model's dtype, as autocast does.
    const Tensor x = as_dtype(x_in, w.dtype(), ws);
    check_conv(x, w, y, "conv2d_forward");
    auto& ts = state();
    ConvPlan& p = plan_for(ts, g, x.dtype());
    choose<cudnnConvolutionFwdAlgoPerf_t, CUDNN_CONVOLUTION_FWD_ALGO_COUNT>(
        p, 0, ws, g, "forward",
        [&](auto* perf, int* n, void* wsp, size_t cap) {
          REPLICA_CUDNN_CHECK(cudnnFindConvolutionForwardAlgorithmEx(ts.cudnn, p.x, x.raw(), p.w, w.raw(), p.conv[0],
                                                                     p.y, y.raw(), CUDNN_CONVOLUTION_FWD_ALGO_COUNT, n,
                                                                     perf, wsp, cap));
        },
        [&](auto* perf, int* n) {
          REPLICA_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(ts.cudnn, p.x, p.w, p.conv[0], p.y,
                                                                     CUDNN_CONVOLUTION_FWD_ALGO_COUNT, n, perf));
        });
    const float alpha = 1.f, beta = 0.f;
    run_conv(p, 0, ws, g, [&](int algo, void* wsp, size_t wsb) {
      REPLICA_CUDNN_CHECK(cudnnConvolutionForward(ts.cudnn, &alpha, p.x, x.raw(), p.w, w.raw(), p.conv[0],
                                                  static_cast<cudnnConvolutionFwdAlgo_t>(algo), wsp, wsb, &beta, p.y,
                                                  y.raw()));
    });
  }

  void conv2d_backward_data(const Tensor& dy, const Tensor& w, const Tensor& dx, const ConvGeom& g,
                            MemoryPool& ws, bool accumulate) override {
    check_conv(dx, w, dy, "conv2d_backward_data");
    auto& ts = state();
    ConvPlan& p = plan_for(ts, g, dy.dtype());
    // Timing writes its output: never into a gradient being added to.
    Tensor timing_out;
    if (!p.chosen[1]) timing_out = accumulate ? Tensor::empty(ws, dx.shape(), dx.dtype(), MemTag::workspace) : dx;
    choose<cudnnConvolutionBwdDataAlgoPerf_t, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT>(
        p, 1, ws, g, "backward-data",
        [&](auto* perf, int* n, void* wsp, size_t cap) {
          REPLICA_CUDNN_CHECK(cudnnFindConvolutionBackwardDataAlgorithmEx(ts.cudnn, p.w, w.raw(), p.y, dy.raw(),
                                                                          p.conv[1], p.x, timing_out.raw(),
                                                                          CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, n, perf,
                                                                          wsp, cap));
        },
        [&](auto* perf, int* n) {
          REPLICA_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(ts.cudnn, p.w, p.y, p.conv[1], p.x,
                                                                          CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, n, perf));
        });
    timing_out = Tensor();
    // beta = 1: dx = conv + dx, the sum formed in f32 and rounded once (a residual block's join).
    const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
    run_conv(p, 1, ws, g, [&](int algo, void* wsp, size_t wsb) {
      REPLICA_CUDNN_CHECK(cudnnConvolutionBackwardData(ts.cudnn, &alpha, p.w, w.raw(), p.y, dy.raw(), p.conv[1],
                                                       static_cast<cudnnConvolutionBwdDataAlgo_t>(algo), wsp, wsb,
                                                       &beta, p.x, dx.raw()));
    });
  }

  void conv2d_backward_filter(const Tensor& x_in, const Tensor& dy, const Tensor& dw, const ConvGeom& g,
                              MemoryPool& ws) override {
    const Tensor x = as_dtype(x_in, dy.dtype(), ws);
    check_conv(x, dy, dy, "conv2d_backward_filter");
    require_f32(dw, "conv2d_backward_filter (weight gradient)");
    auto& ts = state();
    ConvPlan& p = plan_for(ts, g, x.dtype());
    // cuDNN wants the filter gradient in the data's type: a 16-bit run computes it into a 16-bit
    // buffer (as PyTorch AMP does) and adds that into the f32 gradient.
    const bool direct = x.dtype() == DType::f32;
    Tensor target = direct ? dw : Tensor::empty(ws, dw.shape(), x.dtype(), MemTag::workspace);
    if (!p.chosen[2]) {
      // Timing writes its output: never into the accumulating gradient.
      Tensor out = direct ? Tensor::empty(ws, dw.shape(), x.dtype(), MemTag::workspace) : target;
      choose<cudnnConvolutionBwdFilterAlgoPerf_t, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT>(
          p, 2, ws, g, "backward-filter",
          [&](auto* perf, int* n, void* wsp, size_t cap) {
            REPLICA_CUDNN_CHECK(cudnnFindConvolutionBackwardFilterAlgorithmEx(
                ts.cudnn, p.x, x.raw(), p.y, dy.raw(), p.conv[2], p.w, out.raw(), CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT,
                n, perf, wsp, cap));
          },
          [&](auto* perf, int* n) {
            REPLICA_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                ts.cudnn, p.x, p.y, p.conv[2], p.w, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, n, perf));
          });
    }
    const float alpha = 1.f, beta = direct ? 1.f : 0.f;
    run_conv(p, 2, ws, g, [&](int algo, void* wsp, size_t wsb) {
      REPLICA_CUDNN_CHECK(cudnnConvolutionBackwardFilter(ts.cudnn, &alpha, p.x, x.raw(), p.y, dy.raw(), p.conv[2],
                                                         static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo), wsp, wsb,
                                                         &beta, p.w, target.raw()));
    });
    if (!direct) cuk::axpy(1.f, dp(target), dp(dw), dw.numel(), stream());
  }

  void batchnorm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y,
                               const Tensor& save_mean, const Tensor& save_invstd, const Tensor& running_mean,
                               const Tensor& running_var, float momentum, float eps, const AllReduceFn& allreduce,
                               const Tensor& residual, bool relu) override {
    const int C = channels(x);
    const int64_t M = x.numel() / C;
    auto& ts = state();
    cudaStream_t s = stream();
    // scratch: acc[2C + 1] doubles (shifted sums, count, shifted squares) | f[2C + 1] floats for
    // the sync-BN reduction | a[C] | b[C] | the per-block partial sums (kernels.h, bn_partials)
    const size_t head = align_up((2 * C + 1) * sizeof(double) + (4 * C + 1) * sizeof(float));
    char* base = static_cast<char*>(ts.get_scratch(head + cuk::bn_partials(M, C) * sizeof(double)));
    double* acc = reinterpret_cast<double*>(base);
    float* f = reinterpret_cast<float*>(acc + 2 * C + 1);
    float* a = f + 2 * C + 1;
    float* b = a + C;
    double* part = reinterpret_cast<double*>(base + head);
    // One pass for both moments, shifted by the running mean (identical on every replica under
    // sync-BN: all of them update it from the same global statistics), or by 0 where the running
    // mean is not finite (kernels.cu, bn_shift).
    cuk::bn_shifted_moments(dp(x), M, C, running_mean.data<float>(), part, acc, s);  // and acc[C] = M
    reduce(acc, f, 2 * C + 1, allreduce, s);  // one reduction for sums, count and squares
    cuk::bn_finalize_train(acc, C, dp(gamma), dp(beta), eps, momentum, save_mean.data<float>(),
                           save_invstd.data<float>(), running_mean.data<float>(), running_var.data<float>(), a, b, s);
    cuk::bn_apply(dp(x), residual_of(x, residual), dp(y), M, C, a, b, relu, s);
  }

  void batchnorm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y,
                              const Tensor& running_mean, const Tensor& running_var, float eps, const Tensor& residual,
                              bool relu) override {
    const int C = channels(x);
    const cuk::DPtr res = residual_of(x, residual);
    auto& ts = state();
    float* a = static_cast<float*>(ts.get_scratch(2 * C * sizeof(float)));
    cuk::bn_coefficients_eval(dp(gamma), dp(beta), running_mean.data<float>(), running_var.data<float>(), eps, C, a,
                              a + C, stream());
    cuk::bn_apply(dp(x), res, dp(y), x.numel() / C, C, a, a + C, relu, stream());
  }

  void batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                          const Tensor& save_invstd, const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta,
                          const AllReduceFn& allreduce, const Tensor& relu_y) override {
    const int C = channels(x);
    const int64_t M = x.numel() / C;
    auto& ts = state();
    cudaStream_t s = stream();
    const cuk::DPtr ry = relu_y.defined() ? dp(relu_y) : cuk::DPtr{};  // the fused ReLU's mask: dy masked in place
    // scratch: acc[2C + 1] (sum dy, sum dy * xhat, count) doubles | f[2C + 1] floats | partials
    const size_t head = align_up((2 * C + 1) * (sizeof(double) + sizeof(float)));
    char* base = static_cast<char*>(ts.get_scratch(head + cuk::bn_partials(M, C) * sizeof(double)));
    double* acc = reinterpret_cast<double*>(base);
    float* f = reinterpret_cast<float*>(acc + 2 * C + 1);
    double* part = reinterpret_cast<double*>(base + head);
    // The fold also adds the local sums into dbeta / dgamma and stores the count acc[2C].
    const cuk::BnFold fold{acc + 2 * C, static_cast<double>(M), dbeta.data<float>(), dgamma.data<float>()};
    cuk::bn_backward_sums(dp(dy), ry, dp(x), M, C, save_mean.data<float>(), save_invstd.data<float>(), part, acc, fold,
                          s);
    reduce(acc, f, 2 * C + 1, allreduce, s);  // sync-BN: dx needs the sums over the global batch
    cuk::bn_backward_apply(dp(dy), dp(x), dp(gamma), save_mean.data<float>(), save_invstd.data<float>(), acc, dp(dx),
                           M, C, s);
  }

  void batchnorm_backward_frozen(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                 const Tensor& invstd, const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta,
                                 const Tensor& relu_y) override {
    const int C = channels(x);
    const int64_t M = x.numel() / C;
    auto& ts = state();
    cudaStream_t s = stream();
    const cuk::DPtr ry = relu_y.defined() ? dp(relu_y) : cuk::DPtr{};
    const size_t head = align_up(2 * C * sizeof(double));
    char* base = static_cast<char*>(ts.get_scratch(head + cuk::bn_partials(M, C) * sizeof(double)));
    double* acc = reinterpret_cast<double*>(base);
    const cuk::BnFold fold{nullptr, 0, dbeta.data<float>(), dgamma.data<float>()};
    cuk::bn_backward_sums(dp(dy), ry, dp(x), M, C, mean.data<float>(), invstd.data<float>(),
                          reinterpret_cast<double*>(base + head), acc, fold, s);
    cuk::bn_backward_apply(dp(dy), dp(x), dp(gamma), mean.data<float>(), invstd.data<float>(), nullptr, dp(dx), M, C,
                           s);
  }

  void relu_forward(const Tensor& x, const Tensor& y) override {
    require_same(x, y, "relu_forward");
    cuk::relu_forward(dp(x), dp(y), x.numel(), stream());
  }
  void relu_backward(const Tensor& y, const Tensor& dy, const Tensor& dx) override {
    require_same(y, dy, "relu_backward");
    cuk::relu_backward(dp(y), dp(dy), dp(dx), y.numel(), stream());
  }
  void add(const Tensor& a, const Tensor& b, const Tensor& y) override {
    require_same(a, b, "add");
    require_same(a, y, "add");
    cuk::add(dp(a), dp(b), dp(y), a.numel(), stream());
  }
  void add_relu(const Tensor& a, const Tensor& b, const Tensor& y) override {
    require_same(a, b, "add_relu");
    require_same(a, y, "add_relu");
    cuk::add_relu(dp(a), dp(b), dp(y), a.numel(), stream());
  }
  void axpy(float alpha, const Tensor& x, const Tensor& y) override {
    require_same(x, y, "axpy");
    cuk::axpy(alpha, dp(x), dp(y), x.numel(), stream());
  }
  void fill(const Tensor& y, float value) override {
    require_float(y, "fill");
    cuk::fill(dp(y), value, y.numel(), stream());
  }
  void set_values(const Tensor& dst, const float* values, int64_t n) override {
    if (dst.dtype() != DType::f32 || n < 0 || n > kMaxSetValues || dst.numel() < n)
      throw ShapeError("set_values: " + std::to_string(n) + " values do not fit " + dst.str() + " (f32, at most " +
                       std::to_string(kMaxSetValues) + ")");
    cuk::set_values(dst.data<float>(), values, static_cast<int>(n), stream());
  }
  void scale(const Tensor& y, float alpha) override { cuk::scale(dp(y), alpha, y.numel(), stream()); }
  void scale_by(const Tensor& y, const Tensor& factor) override {
    require_f32(y, "scale_by");
    check_factor(factor, y, "scale_by");
    cuk::scale_by(y.data<float>(), y.numel(), factor.data<float>(), stream());
  }

  void maxpool_forward(const Tensor& x, const Tensor& y, const Tensor& argmax, const PoolGeom& g) override {
    cuk::maxpool_forward(dp(x), dp(y), argmax.data<int32_t>(), as_int(g.N, "maxpool"), as_int(g.H, "maxpool"),
                         as_int(g.W, "maxpool"), as_int(g.C, "maxpool"), as_int(g.P, "maxpool"), as_int(g.Q, "maxpool"),
                         static_cast<int>(g.window), static_cast<int>(g.stride), static_cast<int>(g.pad), stream());
  }
  void maxpool_backward(const Tensor& dy, const Tensor& argmax, const Tensor& dx, const PoolGeom& g) override {
    cuk::maxpool_backward(dp(dy), argmax.data<int32_t>(), dp(dx), as_int(g.N, "maxpool"), as_int(g.H, "maxpool"),
                          as_int(g.W, "maxpool"), as_int(g.C, "maxpool"), as_int(g.P, "maxpool"),
                          as_int(g.Q, "maxpool"), static_cast<int>(g.window), static_cast<int>(g.stride),
                          static_cast<int>(g.pad), stream());
  }
  void global_avgpool_forward(const Tensor& x, const Tensor& y) override {
    cuk::global_avgpool_forward(dp(x), dp(y), as_int(x.dim(0), "avgpool"), as_int(x.dim(1) * x.dim(2), "avgpool"),
                                as_int(x.dim(3), "avgpool"), stream());
  }
  void global_avgpool_backward(const Tensor& dy, const Tensor& dx) override {
    cuk::global_avgpool_backward(dp(dy), dp(dx), as_int(dx.dim(0), "avgpool"), as_int(dx.dim(1) * dx.dim(2), "avgpool"),
                                 as_int(dx.dim(3), "avgpool"), stream());
  }

  void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y) override {
    const int N = as_int(x.dim(0), "linear"), I = as_int(x.numel() / x.dim(0), "linear"), O = as_int(w.dim(0), "linear");
    check_linear(x, w, I, O);
    auto& ts = state();
    // y = b broadcast, then y += x w^T: column-major y^T[O,N] = w^T' [O,I] x^T [I,N].
    cuk::bias_broadcast(dp(b), dp(y), N, O, stream());
    gemm(ts, CUBLAS_OP_T, CUBLAS_OP_N, O, N, I, w, I, x, I, 1.f, y, O);
  }

  void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                       const Tensor& db) override {
    const int N = as_int(x.dim(0), "linear"), I = as_int(x.numel() / x.dim(0), "linear"), O = as_int(w.dim(0), "linear");
    check_linear(x, w, I, O);
    require_f32(dw, "linear_backward (weight gradient)");
    require_f32(db, "linear_backward (bias gradient)");
    auto& ts = state();
    if (dx.defined()) gemm(ts, CUBLAS_OP_N, CUBLAS_OP_N, I, N, O, w, I, dy, O, 0.f, dx, I);  // dx = dy w
    gemm(ts, CUBLAS_OP_N, CUBLAS_OP_T, I, O, N, x, I, dy, O, 1.f, dw, I);                   // dw += dy^T x
    cuk::bias_grad(dp(dy), db.data<float>(), N, O, stream());
  }

  LossResult softmax_xent_forward(const Tensor& logits, const Tensor& labels, const Tensor& probs) override {
    auto& ts = state();
    const int K = as_int(logits.dim(1), "softmax_cross_entropy");
    double* result = launch_xent(ts, logits, labels, probs);
    char host[sizeof(double) + 2 * sizeof(int)];
    fetch(ts, result, host, sizeof host);
    double loss;
    int c[2];
    std::memcpy(&loss, host, sizeof loss);
    std::memcpy(c, host + sizeof loss, sizeof c);
    if (c[1]) {
      int32_t bad = 0;
      fetch(ts, labels.data<int32_t>() + (c[1] - 1), &bad, sizeof bad);
      throw ShapeError("softmax_cross_entropy: label " + std::to_string(bad) + " of sample " + std::to_string(c[1] - 1) +
                       " is outside [0, " + std::to_string(K) + ")");
    }
    return {loss, c[0]};
  }

  void softmax_xent_accumulate(const Tensor& logits, const Tensor& labels, const Tensor& probs,
                               const Tensor& sums) override {
    if (sums.dtype() != DType::f32 || sums.numel() < 3)
      throw ShapeError("softmax_xent_accumulate: sums must be f32 with 3 elements, got " + sums.str());
    auto& ts = state();
    double* result = launch_xent(ts, logits, labels, probs);
    cuk::xent_fold(result, reinterpret_cast<int*>(result + 1), sums.data<float>(), stream());
  }

  void softmax_xent_backward(const Tensor& probs, const Tensor& labels, const StepScalar& scale,
                             const Tensor& dlogits) override {
    cuk::softmax_xent_backward(dp(probs), labels.data<int32_t>(), knob(scale, dlogits, "softmax_xent_backward"),
                               dp(dlogits), as_int(probs.dim(0), "xent"),
                               as_int(probs.dim(1), "xent"), stream());
  }

  void cast(const Tensor& src, const Tensor& dst) override {
    require_same(src, dst, "cast");
    require_float(src, "cast");
    require_float(dst, "cast");
    cuk::cast(dp(src), dp(dst), src.numel(), stream());
  }

  // [offset, count) segments of `x` as two device arrays (the offsets, then the counts), and
  // `extra` bytes of this thread's scratch for the caller's results; a segment past the end of x
  // is a ShapeError naming `who`. The tables of the step's fixed reductions (the gradient norm's
  // blocks, LARS's tensors) are the same every step: each distinct one is uploaded once and kept
  // for the thread's life (ThreadState::segment_tables), so a step stages no pageable copy for
  // them (a copy the driver may order after the stream's queued work, and one no CUDA graph may
  // hold). Past kKeptSegmentTables distinct tables a table is staged into the scratch per call;
  // inside a CUDA graph capture, a table not kept is an error.
  struct SegmentTable {
    const int64_t* table;
    void* extra;
  };
  SegmentTable upload_segments(const std::vector<std::pair<int64_t, int64_t>>& segments, const Tensor& x,
                               const char* who, size_t extra) {
    for (const auto& [off, cnt] : segments)
      if (off < 0 || off + cnt > x.numel()) throw ShapeError(std::string(who) + ": segment past the end of " + x.str());
    auto& ts = state();
    if (const int64_t* kept = kept_table(segments)) return {kept, extra ? ts.get_scratch(extra) : nullptr};
    // A copy from this call's host vector would sit in a captured graph and read freed memory at
    // every replay: a table first seen inside a capture fails it (train.cuda_graph then runs eagerly).
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    REPLICA_CUDA_CHECK(cudaStreamIsCapturing(stream(), &cs));
    if (cs != cudaStreamCaptureStatusNone)
      throw CudaError(std::string(who) + ": a segment table not kept before the CUDA graph capture (" +
                      std::to_string(segments.size()) + " segments); the eager steps before it keep the step's tables");
    const std::vector<int64_t> oc = flatten(segments);
    const size_t bytes = oc.size() * sizeof(int64_t);
    auto* d = static_cast<char*>(ts.get_scratch(bytes + extra));
    REPLICA_CUDA_CHECK(cudaMemcpyAsync(d, oc.data(), bytes, cudaMemcpyHostToDevice, stream()));
    return {reinterpret_cast<int64_t*>(d), d + bytes};
  }
  // [offsets..., counts...]
  static std::vector<int64_t> flatten(const std::vector<std::pair<int64_t, int64_t>>& segments) {
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
  const int64_t* kept_table(const std::vector<std::pair<int64_t, int64_t>>& segments) {
    auto& ts = state();
    for (const auto& t : ts.segment_tables)
      if (t.first == segments) return t.second;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    REPLICA_CUDA_CHECK(cudaStreamIsCapturing(stream(), &cs));
    if (ts.segment_tables.size() >= ThreadState::kKeptSegmentTables || cs != cudaStreamCaptureStatusNone) return nullptr;
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

  double sum_squares(const Tensor& x) override {
    require_f32(x, "sum_squares");
    auto& ts = state();
    double* out = static_cast<double*>(ts.get_scratch((1 + cuk::kReduceBlocks) * sizeof(double)));
    cuk::sum_squares(x.data<float>(), x.numel(), out, out + 1, stream());
    double r = 0;
    fetch(ts, out, &r, sizeof r);
    return r;
  }

  std::vector<double> segment_sum_squares(const Tensor& x,
                                          const std::vector<std::pair<int64_t, int64_t>>& segments) override {
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

  bool unscale_check_finite(const Tensor& grads, float inv_scale) override {
    require_f32(grads, "unscale_check_finite");
    auto& ts = state();
    int* flag = static_cast<int*>(ts.get_scratch(sizeof(int)));
    REPLICA_CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int), stream()));
    cuk::unscale_check(grads.data<float>(), grads.numel(), cuk::Knob{inv_scale, nullptr}, flag, stream());
    int bad = 0;
    fetch(ts, flag, &bad, sizeof bad);
    return bad == 0;
  }

  void sum_squares_into(const Tensor& x, const Tensor& out) override {
    require_f32(x, "sum_squares");
    require_f32(out, "sum_squares (output)");
    auto& ts = state();
    double* acc = static_cast<double*>(ts.get_scratch((1 + cuk::kReduceBlocks) * sizeof(double)));
    cuk::sum_squares(x.data<float>(), x.numel(), acc, acc + 1, stream());
    cuk::doubles_to_floats(acc, out.data<float>(), 1, stream());
  }

  void segment_sum_squares_into(const Tensor& x, const std::vector<std::pair<int64_t, int64_t>>& segments,
                                const Tensor& out) override {
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

  void sum_in_order_into(const Tensor& x, const Tensor& out) override {
    require_f32(x, "sum_in_order_into");
    require_f32(out, "sum_in_order_into (output)");
    cuk::sum_in_order(x.data<float>(), x.numel(), out.data<float>(), stream());
  }

  void unscale_check_finite_into(const Tensor& grads, const StepScalar& inv_scale, const Tensor& nonfinite) override {
    require_f32(grads, "unscale_check_finite");
    require_f32(nonfinite, "unscale_check_finite (flag)");
    cuk::unscale_check(grads.data<float>(), grads.numel(), knob(inv_scale, grads, "unscale_check_finite_into"),
                       nonfinite.data<float>(), stream());
  }

  void read_to_host(const Tensor& src, void* dst, const std::function<void()>& poll) override {
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

  void rsqrt_eps(const Tensor& x, const Tensor& y, float eps) override {
    require_f32(x, "rsqrt_eps");
    require_f32(y, "rsqrt_eps");
    cuk::rsqrt_eps(x.data<float>(), y.data<float>(), eps, x.numel(), stream());
  }

  void sgd_update(const Tensor& p, const Tensor& g, const Tensor& buf, const SgdUpdate& u,
                  const ChunkClasses& classes, const Tensor& copy) override {
    for (const Tensor* t : {&p, &g, &buf}) require_f32(*t, "sgd_update");
    check_chunk_classes(classes, p, DType::u8, false, "sgd_update");
    check_gate(u.gate, p, "sgd_update");
    cuk::sgd_update(p.data<float>(), g.data<float>(), buf.data<float>(), p.numel(), table<uint8_t>(classes),
                    classes.base, knob(u.lr, p, "sgd_update"), u.momentum, u.coupled_wd,
                    knob(u.decoupled_wd, p, "sgd_update"), u.nesterov, knob(u.first, p, "sgd_update"),
                    copy_ptr(copy, p, "sgd_update"), gate_ptr(u.gate), stream());
  }
  void adamw_update(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const AdamWUpdate& u,
                    const ChunkClasses& classes, const Tensor& copy) override {
    for (const Tensor* t : {&p, &g, &m, &v}) require_f32(*t, "adamw_update");
    check_chunk_classes(classes, p, DType::u8, false, "adamw_update");
    check_gate(u.gate, p, "adamw_update");
    cuk::adamw_update(p.data<float>(), g.data<float>(), m.data<float>(), v.data<float>(), p.numel(),
                      table<uint8_t>(classes), classes.base, u.beta1, u.beta2, u.eps, knob(u.decay, p, "adamw_update"),
                      knob(u.step_size, p, "adamw_update"), knob(u.inv_sqrt_bc2, p, "adamw_update"),
                      copy_ptr(copy, p, "adamw_update"), gate_ptr(u.gate), stream());
  }
  void lars_trust_ratios(const Tensor& params, const Tensor& grads,
                         const std::vector<std::pair<int64_t, int64_t>>& segments, float trust, float wd, float eps,
                         const Tensor& ratios) override {
    for (const Tensor* t : {&params, &grads, &ratios}) require_f32(*t, "lars_trust_ratios");
    const int n = static_cast<int>(segments.size());
    if (ratios.numel() < n) throw ShapeError("lars_trust_ratios: " + ratios.str() + " holds too few ratios");
    if (n == 0) return;
    for (const auto& [off, cnt] : segments)
      if (off < 0 || off + cnt > params.numel())
        throw ShapeError("lars_trust_ratios: segment past the end of " + params.str());
    // Each tensor cut into kLarsChunk-element chunks (a block each), and each tensor's run of
    // chunks: two fixed tables, kept on the device after their first upload (kept_table).
    std::vector<std::pair<int64_t, int64_t>> chunks, runs;
    for (const auto& [off, cnt] : segments) {
      const int64_t first = static_cast<int64_t>(chunks.size());
      for (int64_t a = 0; a < cnt; a += cuk::kLarsChunk) chunks.emplace_back(off + a, std::min(cuk::kLarsChunk, cnt - a));
      runs.emplace_back(first, static_cast<int64_t>(chunks.size()) - first);
    }
    const int nc = static_cast<int>(chunks.size());
    const int64_t* c = kept_table(chunks);
    const int64_t* r = kept_table(runs);
    // The partial sums, and any table that could not be kept, staged in one scratch region.
    const size_t part_bytes = std::max<size_t>(1, 2 * chunks.size()) * sizeof(double);
    const size_t cb = c ? 0 : 2 * chunks.size() * sizeof(int64_t), rb = r ? 0 : 2 * runs.size() * sizeof(int64_t);
    char* base = static_cast<char*>(state().get_scratch(part_bytes + cb + rb));
    if (!c) {
      const auto oc = flatten(chunks);
      REPLICA_CUDA_CHECK(cudaMemcpyAsync(base + part_bytes, oc.data(), cb, cudaMemcpyHostToDevice, stream()));
      c = reinterpret_cast<const int64_t*>(base + part_bytes);
    }
    if (!r) {
      const auto oc = flatten(runs);
      REPLICA_CUDA_CHECK(cudaMemcpyAsync(base + part_bytes + cb, oc.data(), rb, cudaMemcpyHostToDevice, stream()));
      r = reinterpret_cast<const int64_t*>(base + part_bytes + cb);
    }
    cuk::lars_ratios(params.data<float>(), grads.data<float>(), c, c + nc, nc, r, r + n, n,
                     reinterpret_cast<double*>(base), trust, wd, eps, ratios.data<float>(), stream());
  }
  // The table's entries name ratios: the caller (optim::Lars) builds both, so the kernel trusts
  // them (checking each entry would be a pass over the table).
  void lars_update(const Tensor& p, const Tensor& g, const Tensor& buf, const StepScalar& lr, const Tensor& ratios,
                   float momentum, float wd, const ChunkClasses& classes, const Tensor& copy,
                   const Tensor& gate) override {
    for (const Tensor* t : {&p, &g, &buf}) require_f32(*t, "lars_update");
    check_chunk_classes(classes, p, DType::i32, true, "lars_update");
    check_gate(gate, p, "lars_update");
    if (ratios.defined()) require_f32(ratios, "lars_update");
    cuk::lars_update(p.data<float>(), g.data<float>(), buf.data<float>(), p.numel(), table<int32_t>(classes),
                     classes.base, knob(lr, p, "lars_update"), ratios.defined() ? ratios.data<float>() : nullptr,
                     momentum, wd,
                     copy_ptr(copy, p, "lars_update"), gate_ptr(gate), stream());
  }
  void step_gate(const Tensor& stats, const StepGateAt& at, double max_norm) override {
    check_step_gate_at(stats, at);
    cuk::step_gate(stats.data<float>(), at.loss, at.bad_label, at.nonfinite, at.grad_squares, at.apply, at.clip,
                   max_norm, stream());
  }

 private:
  // The loss kernel into the thread's scratch: [loss sum (double) | correct, first bad row + 1 (int)].
  static double* launch_xent(ThreadState& ts, const Tensor& logits, const Tensor& labels, const Tensor& probs) {
    const int N = as_int(logits.dim(0), "softmax_cross_entropy"), K = as_int(logits.dim(1), "softmax_cross_entropy");
    if (labels.numel() != N)
      throw ShapeError("softmax_cross_entropy: " + std::to_string(N) + " rows of logits but " +
                       std::to_string(labels.numel()) + " labels");
    cudaStream_t s = stream();
    // scratch: result (double) | counts (2 ints) | each row's loss (N doubles)
    double* result = static_cast<double*>(ts.get_scratch((2 + static_cast<size_t>(N)) * sizeof(double)));
    int* counts = reinterpret_cast<int*>(result + 1);
    REPLICA_CUDA_CHECK(cudaMemsetAsync(counts, 0, 2 * sizeof(int), s));
    cuk::softmax_xent_forward(dp(logits), labels.data<int32_t>(), dp(probs), N, K, result + 2, result, counts, s);
    return result;
  }

  // t itself, or a copy rounded to dt in the workspace pool.
  static Tensor as_dtype(const Tensor& t, DType dt, MemoryPool& ws) {
    if (t.dtype() == dt) return t;
    require_float(t, "conv input");
    Tensor c = Tensor::empty(ws, t.shape(), dt, MemTag::workspace);
    cuk::cast(dp(t), dp(c), t.numel(), stream());
    return c;
  }

  // A batch norm's fused residual (undefined: none), checked against its input.
  static cuk::DPtr residual_of(const Tensor& x, const Tensor& residual) {
    if (!residual.defined()) return {};
    require_float(residual, "batchnorm (residual)");
    require_same(x, residual, "batchnorm (residual)");
    return dp(residual);
  }

  static int channels(const Tensor& x) {
    require_float(x, "batchnorm");
    return as_int(x.shape()[x.shape().rank() - 1], "batchnorm");
  }

  static void check_conv(const Tensor& a, const Tensor& b, const Tensor& c, const char* who) {
    for (const Tensor* t : {&a, &b, &c}) {
      if (t->device().kind != DeviceKind::cuda) throw ShapeError(std::string(who) + ": " + t->str() + " is not on a GPU");
      require_float(*t, who);
    }
    if (a.dtype() != b.dtype() || a.dtype() != c.dtype())
      throw ShapeError(std::string(who) + ": cuDNN needs one dtype for input, filter and output; got " + a.str() + ", " +
                       b.str() + ", " + c.str());
  }

  static void check_linear(const Tensor& x, const Tensor& w, int I, int O) {
    if (w.numel() != static_cast<int64_t>(O) * I)
      throw ShapeError("linear: input " + x.str() + " has " + std::to_string(I) + " features but the weight is " + w.str());
    if (x.dtype() != w.dtype())
      throw ShapeError("linear: input " + x.str() + " and weight " + w.str() + " must share a dtype on the GPU");
  }

  // Column-major C[m,n] = alpha op(A) op(B) + beta C with f32 accumulation (tensor cores for 16-bit
  // data; TF32 for f32 only under REPLICA_ALLOW_TF32).
  static void gemm(ThreadState& ts, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const Tensor& A,
                   int lda, const Tensor& B, int ldb, float beta, const Tensor& C, int ldc) {
    const float alpha = 1.f;
    const cublasComputeType_t ct =
        A.dtype() == DType::f32 && allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    REPLICA_CUBLAS_CHECK(cublasGemmEx(ts.cublas, ta, tb, m, n, k, &alpha, A.raw(), blas_type(A.dtype()), lda, B.raw(),
                                      blas_type(B.dtype()), ldb, &beta, C.raw(), blas_type(C.dtype()), ldc, ct,
                                      CUBLAS_GEMM_DEFAULT));
  }

  // Sums `n` device doubles across replicas: through floats (the CPU backend's convention), in place.
  static void reduce(double* acc, float* f, int n, const AllReduceFn& allreduce, cudaStream_t s) {
    if (!allreduce) return;
    cuk::doubles_to_floats(acc, f, n, s);
    // Replica::psum_on_stream: NCCL on the latency lane, after this stream's work, and this
    // stream waits for it on the device (no host round trip).
    allreduce(f, static_cast<size_t>(n));
    cuk::floats_to_doubles(f, acc, n, s);
  }
};

}  // namespace

Backend& cuda_backend() {
  static CudaBackend backend;
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
