// Forward+backward throughput of a ResNet on one CPU replica (one thread), and the GFLOP/s of
// each distinct convolution against a plain Eigen GEMM of the same (M, N, K).
//   replica_bench_model [--arch resnet20] [--batch 128] [--steps 20] [--hw 28] [--channels 1] [--threads 1]
//                       [--precision fp32,bf16,fp16]
// --precision names the activation dtype (default fp32). With several, one model per dtype is
// stepped in turn (one step each per round), so a noisy machine's slow phases hit them alike;
// each prints img/s and its ratio to the first, overall and as the median of the per-round ratios.
#include <Eigen/Core>
#include <chrono>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/pools.h"
#include "ops/cpu/direct_conv.h"
#include "ops/cpu/threads.h"
#include "ops/models/resnet.h"
#include "ops/nn/training_pass.h"

using namespace replica;
using Clock = std::chrono::steady_clock;

namespace {
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct ConvShape {
  int64_t N, H, W, C, K, R, stride, pad, groups;
  bool operator<(const ConvShape& o) const {
    return std::tie(N, H, W, C, K, R, stride, pad, groups) <
           std::tie(o.N, o.H, o.W, o.C, o.K, o.R, o.stride, o.pad, o.groups);
  }
};
}  // namespace

int main(int argc, char** argv) {
  std::string arch = "resnet20";
  int64_t batch = 128, steps = 20, hw = 28, channels = 1;
  bool shapes_table = true;
  int threads = 1;
  std::vector<DType> precisions{DType::f32};
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--arch") arch = argv[i + 1];
    else if (k == "--batch") batch = std::stoll(argv[i + 1]);
    else if (k == "--steps") steps = std::stoll(argv[i + 1]);
    else if (k == "--hw") hw = std::stoll(argv[i + 1]);
    else if (k == "--channels") channels = std::stoll(argv[i + 1]);
    else if (k == "--shapes") shapes_table = std::string(argv[i + 1]) != "0";
    else if (k == "--threads") threads = std::stoi(argv[i + 1]);
    else if (k == "--precision") {
      precisions.clear();
      std::stringstream list(argv[i + 1]);
      for (std::string item; std::getline(list, item, ',');) precisions.push_back(parse_dtype(item));
    }
    else {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  ops::set_intra_op_threads(threads);
  PoolOptions po;
  po.mode = AllocatorMode::growth;
  auto pool = make_pool({DeviceKind::cpu, 0}, po);
  auto& be = ops::backend_for(pool->device());
  auto make_model = [&](DType compute) {
    auto m = models::make_resnet({.arch = arch, .in_channels = channels, .num_classes = 10, .height = hw, .width = hw});
    m->materialize(*pool, 1, compute);
    return m;
  };
  Tensor x = Tensor::empty(*pool, {batch, hw, hw, channels}, DType::f32, MemTag::activations);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = nd(rng);
  Tensor labels = Tensor::empty(*pool, {batch}, DType::i32, MemTag::activations);
  for (int64_t i = 0; i < batch; ++i) labels.data<int32_t>()[i] = static_cast<int32_t>(i % 10);

  auto step_of = [&](nn::Model& m, DType act) {
    nn::Context ctx(*pool, be, true);
    ctx.act_dtype = act;
    Tensor d;
    nn::forward_and_loss(ctx, m, x, labels, 1.f / batch, d);
    m.zero_grad();
    m.backward(ctx, d);
  };
  // One model per precision, stepped in turn; with one precision this is a plain timing loop.
  std::vector<std::unique_ptr<nn::Model>> models;
  for (DType p : precisions) models.push_back(make_model(p));
  for (int i = 0; i < 3; ++i)
    for (size_t m = 0; m < models.size(); ++m) step_of(*models[m], precisions[m]);
  std::vector<double> total(models.size(), 0);
  std::vector<std::vector<double>> ratios(models.size());
  for (int64_t i = 0; i < steps; ++i) {
    std::vector<double> t(models.size());
    for (size_t m = 0; m < models.size(); ++m) {
      auto t0 = Clock::now();
      step_of(*models[m], precisions[m]);
      t[m] = seconds_since(t0);
      total[m] += t[m];
    }
    for (size_t m = 0; m < models.size(); ++m) ratios[m].push_back(t[0] / t[m]);
  }
  if (models.size() > 1) {
    std::printf("# %s fwd+bwd, batch %ld, %ldx%ldx%ld, %d thread%s, %ld interleaved steps per precision\n", arch.c_str(),
                batch, hw, hw, channels, threads, threads > 1 ? "s" : "", steps);
    std::printf("# %-9s %10s %14s %22s\n", "precision", "img/s", "vs first", "median per-step ratio");
    for (size_t m = 0; m < models.size(); ++m) {
      auto& r = ratios[m];
      std::sort(r.begin(), r.end());
      const double med = r.size() % 2 ? r[r.size() / 2] : 0.5 * (r[r.size() / 2 - 1] + r[r.size() / 2]);
      std::printf("  %-9s %10.1f %13.3fx %21.3fx\n", dtype_name(precisions[m]), steps * batch / total[m],
                  total[0] / total[m], med);
    }
    return 0;
  }
  const double dt = total[0];
  std::printf("# %s fwd+bwd, batch %ld, %ldx%ldx%ld, %d thread%s, %s activations\n", arch.c_str(), batch, hw, hw,
              channels, threads, threads > 1 ? "s" : "", dtype_name(precisions[0]));
  std::printf("replica img/s %.1f  (%.1f ms/step, peak pool in use %.1f MiB)\n", steps * batch / dt,
              1e3 * dt / steps, pool->stats().peak_in_use / 1048576.0);
  auto& model = models[0];

  if (!shapes_table) return 0;
  // Per-shape conv GFLOP/s (forward, backward-data, backward-filter) against Eigen GEMM.
  std::map<ConvShape, int> shapes;
  Shape s{batch, hw, hw, channels};
  for (const ops::ConvGeom& g : nn::conv_geometries(model->root(), s))
    shapes[{g.N, g.H, g.W, g.C, g.K, g.R, g.stride, g.pad, g.groups}]++;
  using MatR = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  std::printf("# conv shape (N,H,W,C->K,RxR,stride)   count  fwd GF/s  bwd-data GF/s  bwd-filter GF/s  GEMM GF/s (same M,N,K)\n");
  for (auto& [c, count] : shapes) {
    auto g = ops::ConvGeom::make({c.N, c.H, c.W, c.C}, c.K, c.R, c.R, c.stride, c.pad, "bench", c.groups);
    const int64_t Cf = g.filter_channels();  // a grouped layer's filter sees C / groups channels
    Tensor in = Tensor::empty(*pool, {c.N, c.H, c.W, c.C}, DType::f32, MemTag::activations);
    Tensor w = Tensor::empty(*pool, {c.K, c.R, c.R, Cf}, DType::f32, MemTag::params);
    Tensor out = Tensor::empty(*pool, {c.N, g.P, g.Q, c.K}, DType::f32, MemTag::activations);
    // Passes write their own outputs (dx, dw), so no pass changes another's inputs between
    // repetitions (values that drift towards denormals or infinities time something else).
    Tensor dx = Tensor::empty(*pool, {c.N, c.H, c.W, c.C}, DType::f32, MemTag::activations);
    Tensor dw = Tensor::empty(*pool, {c.K, c.R, c.R, Cf}, DType::f32, MemTag::grads);
    for (auto* t : {&in, &w, &out, &dw}) std::fill_n(t->data<float>(), t->numel(), 0.01f);
    double flops = 2.0 * c.N * g.P * g.Q * c.K * c.R * c.R * Cf;
    // Best of 5 bursts of 40 ms: the machines are shared, and a burst that met a neighbour's
    // work says nothing about the kernel.
    auto time = [&](auto fn) {
      fn();
      double best = 0;
      for (int burst = 0; burst < 5; ++burst) {
        auto t = Clock::now();
        int reps = 0;
        while (seconds_since(t) < 0.04) {
          fn();
          reps++;
        }
        best = std::max(best, flops * reps / seconds_since(t) / 1e9);
      }
      return best;
    };
    // The GEMM of the same FLOPs: for a grouped layer, one dense product of its M x (R R C / groups) x K.
    int64_t M = c.N * g.P * g.Q, K = c.R * c.R * Cf;
    MatR A = MatR::Constant(M, K, 0.01f), B = MatR::Constant(c.K, K, 0.01f), C(M, c.K);
    // Layers Winograd serves are timed three ways, one after the other: the direct kernels
    // (REPLICA_WINOGRAD=0), F(2x2, 3x3) and F(4x4, 3x3) (REPLICA_WINOGRAD_TILE=2 / 4).
    const bool both = ops::direct::serves_winograd(g) && c.groups == 1;  // grouped layers have one kernel
    const bool winograd_was = ops::direct::winograd_enabled();
    const int tile_was = ops::direct::set_winograd_tile(0);
    for (int path = both ? 0 : 2; path < 3; ++path) {
      if (both) {
        ops::direct::set_winograd(path > 0);
        ops::direct::set_winograd_tile(path == 1 ? 2 : 4);
      }
      double f = time([&] { be.conv2d_forward(in, w, out, g, *pool); });
      double bd = time([&] { be.conv2d_backward_data(out, w, dx, g, *pool, false); });
      double bf = time([&] {
        std::fill_n(dw.data<float>(), dw.numel(), 0.f);  // small: not what is timed
        be.conv2d_backward_filter(in, out, dw, g, *pool);
      });
      double gemm = time([&] { C.noalias() = A * B.transpose(); });
      const char* label[] = {"  direct", "  winograd 2x2", "  winograd 4x4"};
      std::printf("  (%3ld,%3ld,%3ld,%3ld->%3ld, %ldx%ld, s%ld)  %5d  %8.1f  %13.1f  %15.1f  %9.1f%s%s\n", c.N, c.H, c.W,
                  c.C, c.K, c.R, c.R, c.stride, count, f, bd, bf, gemm, both ? label[path] : "",
                  c.groups > 1 ? ("  grouped " + std::to_string(c.groups)).c_str() : "");
    }
    ops::direct::set_winograd_tile(tile_was);
    ops::direct::set_winograd(winograd_was);
  }
  return 0;
}
