// The CUDA backend's convolutions through cuDNN (NHWC): a plan per shape and dtype (descriptors
// and each direction's algorithm, chosen once by timing like cudnn.benchmark, or by cuDNN's ranking
// in deterministic mode), workspaces from the replica's pool, and a no-workspace fallback when the
// pool is short.
#include <cstdlib>

#include "core/log.h"
#include "ops/cuda/cuda_backend_impl.h"

namespace replica::ops::cuda_impl {

namespace {

//  - f16 / bf16: CUDNN_TENSOR_OP_MATH (tensor cores; accumulation stays f32 by the descriptor);
//  - f32 with TF32 allowed: CUDNN_DEFAULT_MATH, which on Ampere and later lets cuDNN use TF32
//    tensor cores for f32 data (what PyTorch does with allow_tf32). Not ..._ALLOW_CONVERSION:
//    that one may also down-convert f32 tensors to f16 / bf16, which nobody asked for;
//  - f32 without TF32: CUDNN_FMA_MATH, true f32 arithmetic (what the CPU backend is held to).
cudnnMathType_t conv_math_type(DType dt, bool tf32) {
  if (dt != DType::f32) return CUDNN_TENSOR_OP_MATH;
  return tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
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

std::string geom_str(const ConvGeom& g) {
  return "conv " + std::to_string(g.R) + "x" + std::to_string(g.S) + " stride " + std::to_string(g.stride) + " pad " +
         std::to_string(g.pad) + " on [" + std::to_string(g.N) + "," + std::to_string(g.H) + "," + std::to_string(g.W) +
         "," + std::to_string(g.C) + "] -> " + std::to_string(g.K) + " channels" +
         (g.groups > 1 ? " in " + std::to_string(g.groups) + " groups" : "");
}

ConvPlan& plan_for(ThreadState& ts, const ConvGeom& g, DType dt) {
  // Deterministic mode chooses among fewer algorithms in another way: plans of either mode apart.
  ConvKey key{{g.N, g.H, g.W, g.C, g.K, g.R, g.S, g.stride, g.pad, static_cast<int64_t>(dt) | (deterministic() ? 256 : 0),
               g.groups}};
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
  // A grouped filter holds C / groups input channels (the convolution descriptor's group count).
  REPLICA_CUDNN_CHECK(cudnnSetFilter4dDescriptor(p->w, t, CUDNN_TENSOR_NHWC, as_int(g.K, "conv"),
                                                 as_int(g.filter_channels(), "conv"),
                                                 as_int(g.R, "conv"), as_int(g.S, "conv")));
  const cudnnMathType_t math = conv_math_type(dt, allow_tf32());
  for (auto& c : p->conv) {
    REPLICA_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&c));
    // Cross-correlation, as PyTorch and the CPU backend; accumulation in f32 for every storage type.
    REPLICA_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(c, as_int(g.pad, "conv"), as_int(g.pad, "conv"),
                                                        as_int(g.stride, "conv"), as_int(g.stride, "conv"), 1, 1,
                                                        CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    REPLICA_CUDNN_CHECK(cudnnSetConvolutionMathType(c, math));
    REPLICA_CUDNN_CHECK(cudnnSetConvolutionGroupCount(c, as_int(g.groups, "conv")));
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
  // Inside a CUDA graph capture (a shape first seen there) nothing can be timed: cuDNN's ranking
  // chooses, and the capture goes on instead of failing (train.cuda_graph).
  const bool in_capture = capturing();
  if (in_capture)
    log_info("cuDNN: ", what, " algorithm for ", geom_str(g),
             " chosen by cuDNN's ranking inside a CUDA graph capture (no timing there)");
  if (use_find() && !deterministic() && !in_capture) {
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
      // Inside a capture the pool is the graph's private one: its shortfall fails the capture
      // (graphs off, saying why) and leaves the plan as chosen, never switching it for good.
      if (p.fallback[dir] < 0 || capturing()) throw;
      log_warn("cuDNN: no room for a ", format_bytes(p.ws[dir]), " workspace for ", geom_str(g),
               "; using an algorithm without one (slower)");
      algo = p.fallback[dir];
      p.algo[dir] = algo;
      p.ws[dir] = 0;
    }
  }
  call(algo, ws.defined() ? ws.raw() : nullptr, ws.defined() ? p.ws[dir] : size_t(0));
}

}  // namespace

void CudaBackend::conv2d_forward(const Tensor& x_in, const Tensor& w, const Tensor& y, const ConvGeom& g,
                    MemoryPool& ws) {
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

void CudaBackend::conv2d_backward_data(const Tensor& dy, const Tensor& w, const Tensor& dx, const ConvGeom& g,
                          MemoryPool& ws, bool accumulate) {
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

void CudaBackend::conv2d_backward_filter(const Tensor& x_in, const Tensor& dy, const Tensor& dw, const ConvGeom& g,
                            MemoryPool& ws) {
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

// t itself, or a copy rounded to dt in the workspace pool.
Tensor CudaBackend::as_dtype(const Tensor& t, DType dt, MemoryPool& ws) {
  if (t.dtype() == dt) return t;
  require_float(t, "conv input");
  Tensor c = Tensor::empty(ws, t.shape(), dt, MemTag::workspace);
  cuk::cast(dp(t), dp(c), t.numel(), stream());
  return c;
}

void CudaBackend::check_conv(const Tensor& a, const Tensor& b, const Tensor& c, const char* who) {
  for (const Tensor* t : {&a, &b, &c}) {
    if (t->device().kind != DeviceKind::cuda) throw ShapeError(std::string(who) + ": " + t->str() + " is not on a GPU");
    require_float(*t, who);
  }
  if (a.dtype() != b.dtype() || a.dtype() != c.dtype())
    throw ShapeError(std::string(who) + ": cuDNN needs one dtype for input, filter and output; got " + a.str() + ", " +
                     b.str() + ", " + c.str());
}

}  // namespace replica::ops::cuda_impl
