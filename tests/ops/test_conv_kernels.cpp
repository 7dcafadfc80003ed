// The CPU convolution kernels against a double-precision reference: the direct NHWC kernels
// (ops/cpu/direct_conv.h) and the im2col + GEMM path, on geometries that reach every remainder
// of the direct kernels (pixels mod 6, taps mod 6, K = 16 m + 8), strides, paddings, 1x1 and
// 5x5 filters, and the ResNet-20 layer shapes; forward, backward data and backward filter (+=).
// The error bound is relative to the sum of |terms| of each output, as f32 accumulation allows.
// Every case runs on every CPU kernel copy this CPU can run (ops/cpu/isa.h: baseline, avx2,
// avx512), with the direct kernels on and off where the copy uses them, and with Winograd
// F(2x2, 3x3) and F(4x4, 3x3) on and off where the direct kernels run (ops/cpu/winograd_kernels.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/errors.h"
#include "ops/backend.h"
#include "ops/cpu/direct_conv.h"
#include "ops/cpu/tuning.h"
#include "ops/cpu/isa.h"
#include "support/layer_harness.h"

using namespace replica;

namespace {

struct Geom {
  int64_t N, H, W, C, K, R, stride, pad;
};

std::string name_of(const Geom& c) {
  return std::to_string(c.N) + "x" + std::to_string(c.H) + "x" + std::to_string(c.W) + "x" + std::to_string(c.C) +
         "_to" + std::to_string(c.K) + "_k" + std::to_string(c.R) + "s" + std::to_string(c.stride) + "p" +
         std::to_string(c.pad);
}

// Reference sums in double with the sum of |terms| beside each, for the error bound.
struct Reference {
  std::vector<double> y, y_abs, dx, dx_abs, dw, dw_abs;
};

Reference reference(const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& dy,
                    const std::vector<float>& dw0, const ops::ConvGeom& g) {
  Reference ref;
  ref.y.assign(g.N * g.P * g.Q * g.K, 0);
  ref.y_abs = ref.y;
  ref.dx.assign(g.N * g.H * g.W * g.C, 0);
  ref.dx_abs = ref.dx;
  ref.dw.assign(dw0.begin(), dw0.end());
  ref.dw_abs.assign(dw0.size(), 0);
  for (size_t i = 0; i < dw0.size(); ++i) ref.dw_abs[i] = std::abs(dw0[i]);
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t p = 0; p < g.P; ++p)
      for (int64_t q = 0; q < g.Q; ++q)
        for (int64_t r = 0; r < g.R; ++r)
          for (int64_t s = 0; s < g.S; ++s) {
            const int64_t h = p * g.stride - g.pad + r, v = q * g.stride - g.pad + s;
            if (h < 0 || h >= g.H || v < 0 || v >= g.W) continue;
            for (int64_t k = 0; k < g.K; ++k) {
              const int64_t yi = ((n * g.P + p) * g.Q + q) * g.K + k;
              for (int64_t c = 0; c < g.C; ++c) {
                const int64_t xi = ((n * g.H + h) * g.W + v) * g.C + c, wi = ((k * g.R + r) * g.S + s) * g.C + c;
                ref.y[yi] += double(x[xi]) * w[wi];
                ref.y_abs[yi] += std::abs(double(x[xi]) * w[wi]);
                ref.dx[xi] += double(dy[yi]) * w[wi];
                ref.dx_abs[xi] += std::abs(double(dy[yi]) * w[wi]);
                ref.dw[wi] += double(dy[yi]) * x[xi];
                ref.dw_abs[wi] += std::abs(double(dy[yi]) * x[xi]);
              }
            }
          }
  return ref;
}

// The largest |got - want| / (sum of |terms| + tiny) over one output.
double worst(const Tensor& got, const std::vector<double>& want, const std::vector<double>& abs_sum) {
  double e = 0;
  for (size_t i = 0; i < want.size(); ++i)
    e = std::max(e, std::abs(got.data<float>()[i] - want[i]) / (abs_sum[i] + 1e-30));
  return e;
}

std::vector<float> random_values(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<float> v(n);
  for (auto& f : v) f = d(rng);
  return v;
}

Tensor tensor_of(MemoryPool& pool, const std::vector<float>& v, Shape s) {
  Tensor t = Tensor::empty(pool, s, DType::f32, MemTag::activations);
  std::copy(v.begin(), v.end(), t.data<float>());
  return t;
}

// One convolution's three passes on `be` from host inputs: y, dx, and dw0 + the weight gradient.
struct Passes {
  Tensor y, dx, dw;
};
Passes run_passes(ops::Backend& be, MemoryPool& pool, const std::vector<float>& x, const std::vector<float>& w,
                  const std::vector<float>& dy, const std::vector<float>& dw0, const ops::ConvGeom& g) {
  Tensor X = tensor_of(pool, x, {g.N, g.H, g.W, g.C}), Wt = tensor_of(pool, w, {g.K, g.R, g.S, g.C});
  Tensor DY = tensor_of(pool, dy, {g.N, g.P, g.Q, g.K});
  Passes p{Tensor::empty(pool, {g.N, g.P, g.Q, g.K}, DType::f32, MemTag::activations),
           Tensor::empty(pool, {g.N, g.H, g.W, g.C}, DType::f32, MemTag::activations),
           tensor_of(pool, dw0, {g.K, g.R, g.S, g.C})};
  be.conv2d_forward(X, Wt, p.y, g, pool);
  be.conv2d_backward_data(DY, Wt, p.dx, g, pool, false);
  be.conv2d_backward_filter(X, DY, p.dw, g, pool);
  return p;
}

// f32 accumulation of up to a few hundred terms: a few ulps of the sum of |terms|.
constexpr double kTol = 2e-6;  // measured: at most 2.2e-7 on every case (F(2x2) Winograd 2.4e-7)
// Winograd F(4x4, 3x3): its transforms scale by up to 5 (input) and 8 (output), so rounding in the
// transformed domain weighs more: measured at most 2.4e-6 of the sum of |terms| (about 20 ulps),
// ten times F(2x2)'s; held to 1e-5. REPLICA_WINOGRAD_TILE=2 trades the speed back for F(2x2)'s.
constexpr double kTolF4 = 1e-5;

// A kernel path: one copy of the CPU kernels, with the direct kernels allowed or not.
struct Path {
  std::string copy;
  bool direct;
  bool zmm = false;  // the avx512 copy's 512-bit direct kernels (REPLICA_DIRECT_ZMM)
  int winograd = 0;  // Winograd's output tile (2 or 4; 0: off) for the 3x3 stride-1 layers it serves
};

std::vector<Path> paths() {
  std::vector<Path> p;
  for (const auto& v : ops::cpu_kernel_variants()) {
    p.push_back({v.name, false});
    if (v.isa >= CpuIsa::avx2) {  // the copies that use the direct kernels and Winograd
      p.push_back({v.name, true});
      p.push_back({v.name, true, false, 2});
      p.push_back({v.name, true, false, 4});
    }
    if (v.isa >= CpuIsa::avx512) p.push_back({v.name, true, true});
  }
  return p;
}

class ConvKernels : public ::testing::TestWithParam<std::tuple<Geom, Path>> {
 protected:
  void TearDown() override {
    ops::direct::set_enabled(true);
    ops::direct::set_zmm(zmm_before_);
    ops::direct::set_winograd(winograd_before_);
    ops::direct::set_winograd_tile(tile_before_);
  }
  bool zmm_before_ = ops::direct::zmm_enabled();
  bool winograd_before_ = ops::direct::winograd_enabled();
  int tile_before_ = ops::direct::set_winograd_tile(0);
};

TEST_P(ConvKernels, MatchDoublePrecision) {
  const Geom c = std::get<0>(GetParam());
  const Path path = std::get<1>(GetParam());  // not a structured binding: clang 14 cannot capture one
  const bool use_direct = path.direct;
  const auto& copies = ops::cpu_kernel_variants();
  const auto copy = std::find_if(copies.begin(), copies.end(), [&](const auto& v) { return path.copy == v.name; });
  if (!cpu_isa_supported(copy->isa)) GTEST_SKIP() << "this CPU cannot run the " << path.copy << " kernels";
  const bool had = ops::direct::set_enabled(use_direct);
  if (use_direct && !had) GTEST_SKIP() << "this CPU has no AVX2/FMA: the direct kernels do not run";
  ops::direct::set_zmm(path.zmm);
  ops::direct::set_winograd(path.winograd != 0);
  ops::direct::set_winograd_tile(path.winograd);
  auto pool = replica::testing::test_pool();
  auto& be = ops::cpu_backend_variant(path.copy);
  const auto g = ops::ConvGeom::make({c.N, c.H, c.W, c.C}, c.K, c.R, c.R, c.stride, c.pad, "test");
  if (path.winograd && !ops::direct::serves_winograd(g))
    GTEST_SKIP() << "Winograd does not serve " << name_of(c) << " (the direct case covers it)";
  std::mt19937 rng(7);
  const auto x = random_values(g.N * g.H * g.W * g.C, rng), w = random_values(g.K * g.R * g.S * g.C, rng),
             dy = random_values(g.N * g.P * g.Q * g.K, rng), dw0 = random_values(w.size(), rng);
  const Reference ref = reference(x, w, dy, dw0, g);
  const Passes got = run_passes(be, *pool, x, w, dy, dw0, g);
  const double ey = worst(got.y, ref.y, ref.y_abs), edx = worst(got.dx, ref.dx, ref.dx_abs),
               edw = worst(got.dw, ref.dw, ref.dw_abs);
  const double tol = path.winograd == 4 ? kTolF4 : kTol;
  EXPECT_LT(ey, tol) << "forward";
  EXPECT_LT(edx, tol) << "backward data";
  EXPECT_LT(edw, tol) << "backward filter (+= onto a random gradient)";
  const bool d = use_direct, wino = d && ops::direct::serves_winograd(g);
  std::printf("%-28s %-8s %s  fwd %.1e (%s)  bwd-data %.1e (%s)  bwd-filter %.1e (%s)\n", name_of(c).c_str(),
              path.copy.c_str(), d ? "direct-capable" : "im2col", ey,
              wino ? "winograd" : d && ops::direct::serves_forward(g) ? "direct" : "im2col", edx,
              wino ? "winograd" : d && ops::direct::serves_backward_data(g) ? "direct" : "im2col", edw,
              wino ? "winograd" : d && ops::direct::serves_backward_filter(g) ? "direct" : "im2col");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ConvKernels,
    ::testing::Combine(::testing::Values(Geom{2, 7, 9, 16, 16, 3, 1, 1},   // 63 pixels: a block of 3
                                         Geom{2, 5, 5, 8, 24, 3, 1, 1},    // K = 16 + 8
                                         Geom{3, 6, 7, 1, 16, 3, 1, 1},    // one input channel (stem)
                                         Geom{2, 9, 8, 16, 32, 3, 2, 1},   // stride 2
                                         Geom{2, 8, 8, 16, 32, 1, 2, 0},   // 1x1 stride 2 (shortcut)
                                         Geom{2, 6, 6, 8, 8, 1, 1, 0},     // pointwise
                                         Geom{2, 9, 9, 8, 16, 5, 1, 2},    // 5x5
                                         Geom{1, 11, 11, 3, 8, 7, 2, 3},   // 7x7 stride 2, 3 channels
                                         Geom{2, 6, 5, 24, 40, 3, 1, 0},   // no padding: dy padded by 2
                                         Geom{2, 28, 28, 16, 16, 3, 1, 1},  // ResNet-20 stage 1
                                         Geom{2, 14, 14, 32, 32, 3, 1, 1},  // stage 2
                                         Geom{2, 7, 7, 64, 64, 3, 1, 1},   // stage 3
                                         Geom{1, 28, 28, 72, 80, 3, 1, 1},  // wide: weight gradient in 4 row bands
                                         // Winograd: odd sizes (edge tiles cut on both sides), K
                                         // = 16 + 8 and C = 8 (GEMM tails), 147 tiles over blocks
                                         Geom{2, 7, 9, 16, 32, 3, 1, 1}, Geom{2, 5, 6, 24, 24, 3, 1, 1},
                                         Geom{3, 7, 7, 8, 64, 3, 1, 1}, Geom{3, 14, 14, 32, 32, 3, 1, 1},
                                         // Winograd's data passes above 64 x 64 (weight gradient direct)
                                         Geom{2, 6, 7, 72, 80, 3, 1, 1}),
                       ::testing::ValuesIn(paths())),
    [](const ::testing::TestParamInfo<std::tuple<Geom, Path>>& i) {
      const Path& p = std::get<1>(i.param);
      return name_of(std::get<0>(i.param)) + "_" + p.copy + (p.direct ? "_direct" : "_im2col") + (p.zmm ? "_zmm" : "") +
             (p.winograd ? "_winograd" + std::to_string(p.winograd) : "");
    });

// 16-bit activations reach the direct kernels (and Winograd's) a chunk at a time
// (converted to f32 and back): the result must be the f32 result of the same rounded inputs,
// rounded once.
TEST(ConvKernels16, DirectAndIm2colAgreeOnBf16AndF16) {
  if (!ops::direct::set_enabled(true)) GTEST_SKIP() << "no AVX2/FMA: the direct kernels do not run";
  auto pool = replica::testing::test_pool();
  auto& be = ops::backend_for(pool->device());
  const bool winograd_before = ops::direct::winograd_enabled();
  for (bool winograd : {false, true}) {
  ops::direct::set_winograd(winograd);
  const int64_t K = 24;
  const auto g = ops::ConvGeom::make({3, 10, 10, 16}, K, 3, 3, 1, 1, "test");
  EXPECT_EQ(ops::direct::serves_winograd(g), winograd);
  for (DType dt : {DType::bf16, DType::f16}) {
    std::mt19937 rng(9);
    auto half = [&](std::vector<float> v, Shape s) {
      Tensor t = Tensor::empty(*pool, s, dt, MemTag::activations);
      convert(v.data(), DType::f32, t.raw(), dt, v.size());
      return t;
    };
    Tensor X = half(random_values(g.N * g.H * g.W * g.C, rng), {g.N, g.H, g.W, g.C});
    Tensor Wt = half(random_values(g.K * g.R * g.S * g.C, rng), {g.K, g.R, g.S, g.C});
    Tensor DY = half(random_values(g.N * g.P * g.Q * g.K, rng), {g.N, g.P, g.Q, g.K});
    std::vector<std::vector<float>> out[2];
    for (int path = 0; path < 2; ++path) {
      ops::direct::set_enabled(path == 0);
      Tensor Y = Tensor::empty(*pool, {g.N, g.P, g.Q, g.K}, dt, MemTag::activations);
      Tensor DX = Tensor::empty(*pool, {g.N, g.H, g.W, g.C}, dt, MemTag::activations);
      Tensor DW = Tensor::zeros(*pool, {g.K, g.R, g.S, g.C}, DType::f32, MemTag::grads);
      be.conv2d_forward(X, Wt, Y, g, *pool);
      be.conv2d_backward_data(DY, Wt, DX, g, *pool, false);
      be.conv2d_backward_filter(X, DY, DW, g, *pool);
      for (const Tensor* t : {&Y, &DX, &DW}) {
        std::vector<float> v(t->numel());
        convert(t->raw(), t->dtype(), v.data(), DType::f32, v.size());
        out[path].push_back(v);
      }
    }
    ops::direct::set_enabled(true);
    const double ulp = dt == DType::bf16 ? 1.0 / 128 : 1.0 / 1024;  // 2 ulps of a 16-bit output
    const char* what[] = {"forward", "backward data", "backward filter (f32)"};
    for (int o = 0; o < 3; ++o)
      for (size_t i = 0; i < out[0][o].size(); ++i) {
        const double a = out[0][o][i], b = out[1][o][i];
        ASSERT_LE(std::abs(a - b), (o == 2 ? 1e-4 : ulp) * std::max(1.0, std::abs(b)))
            << what[o] << " " << dtype_name(dt) << (winograd ? " Winograd" : " direct") << " element " << i;
      }
  }
  }
  ops::direct::set_winograd(winograd_before);
}

// Which layers Winograd serves, and with which output tile: ResNet-20's 3x3 stride-1 layers of
// 16 to 64 channels and ResNet-50's 64 and 128 by F(4x4), ResNet-50's 256 by F(2x2), all three
// passes; not 8 x 16, stride 2, 1x1, the one-channel stem, or 512 channels.
TEST(ConvKernels, WinogradServesThe3x3Stride1LayersItWasMeasuredToWinOn) {
  if (!ops::direct::available()) GTEST_SKIP() << "no AVX2/FMA: neither the direct kernels nor Winograd run";
  const bool was = ops::direct::set_winograd(true);
  const int tile_was = ops::direct::set_winograd_tile(0);
  auto tile = [](Shape in, int64_t K, int64_t R, int64_t stride, int64_t pad) {
    const auto g = ops::ConvGeom::make(in, K, R, R, stride, pad, "test");
    const int m = ops::direct::winograd_tile(g);
    EXPECT_EQ(ops::direct::serves_winograd(g), m != 0);
    return m;
  };
  struct Case {
    Shape in;
    int64_t K, R, stride, pad;
    int tile;  // 0: not served
  };
  const Case cases[] = {{{64, 14, 14, 32}, 32, 3, 1, 1, 4},   {{64, 7, 7, 64}, 64, 3, 1, 1, 4},
                        {{64, 28, 28, 16}, 16, 3, 1, 1, 4},   {{16, 56, 56, 64}, 64, 3, 1, 1, 4},
                        {{16, 28, 28, 128}, 128, 3, 1, 1, 4}, {{16, 14, 14, 256}, 256, 3, 1, 1, 2},
                        {{16, 7, 7, 512}, 512, 3, 1, 1, 0},   {{4, 9, 9, 8}, 16, 3, 1, 1, 0},
                        {{64, 28, 28, 16}, 32, 3, 2, 1, 0},   {{64, 14, 14, 32}, 64, 1, 2, 0, 0},
                        {{64, 28, 28, 1}, 16, 3, 1, 1, 0},    {{64, 14, 14, 32}, 32, 3, 1, 0, 0}};
  for (const Case& c : cases) EXPECT_EQ(tile(c.in, c.K, c.R, c.stride, c.pad), c.tile) << c.in.str() << " -> " << c.K;
  ops::direct::set_winograd_tile(2);
  EXPECT_EQ(tile({64, 14, 14, 32}, 32, 3, 1, 1), 2) << "REPLICA_WINOGRAD_TILE=2 / set_winograd_tile(2) forces F(2x2)";
  EXPECT_THROW(ops::direct::set_winograd_tile(3), ConfigError);
  ops::direct::set_winograd(false);
  EXPECT_EQ(tile({64, 14, 14, 32}, 32, 3, 1, 1), 0) << "REPLICA_WINOGRAD=0 / set_winograd(false) turns it off";
  ops::direct::set_winograd(was);
  ops::direct::set_winograd_tile(tile_was);
}

// The avx512 copy's zmm direct kernels do the AVX2 kernels' FMAs per output element in the same
// order (ops/cpu/direct_kernels.h): on layers the direct kernels serve in all three passes, the
// avx2 copy and the avx512 copy with REPLICA_DIRECT_ZMM give the same bits.
TEST(ConvKernels, DirectKernelsInYmmAndZmmGiveTheSameBits) {
  if (!cpu_isa_supported(CpuIsa::avx512)) GTEST_SKIP() << "this CPU cannot run the avx512 kernels";
  const auto& copies = ops::cpu_kernel_variants();
  auto built = [&](const char* n) {
    return std::any_of(copies.begin(), copies.end(), [&](const auto& v) { return std::string(n) == v.name; });
  };
  if (!built("avx2") || !built("avx512")) GTEST_SKIP() << "this build has no avx2 and avx512 copies";
  if (!ops::direct::set_enabled(true)) GTEST_SKIP() << "the direct kernels are off";
  struct WinogradOff {  // these layers' 3x3 passes are the direct kernels' here, not Winograd's
    bool was = ops::direct::set_winograd(false);
    ~WinogradOff() { ops::direct::set_winograd(was); }
  } winograd_off;
  auto pool = replica::testing::test_pool();
  // K = 16 (one zmm block), K = 80 (two blocks of 32 and one of 16), K = 24 (16 and the ymm 8).
  for (Geom c : {Geom{2, 28, 28, 16, 16, 3, 1, 1}, Geom{1, 28, 28, 72, 80, 3, 1, 1}, Geom{2, 9, 9, 8, 24, 5, 1, 2}}) {
    const auto g = ops::ConvGeom::make({c.N, c.H, c.W, c.C}, c.K, c.R, c.R, c.stride, c.pad, "test");
    ASSERT_TRUE(ops::direct::serves_forward(g) && ops::direct::serves_backward_data(g) &&
                ops::direct::serves_backward_filter(g))
        << name_of(c);
    std::mt19937 rng(11);
    const auto x = random_values(g.N * g.H * g.W * g.C, rng), w = random_values(g.K * g.R * g.S * g.C, rng),
               dy = random_values(g.N * g.P * g.Q * g.K, rng), dw0 = random_values(w.size(), rng);
    std::vector<float> out[2];
    int i = 0;
    for (const char* copy : {"avx2", "avx512"}) {
      const bool zmm_before = ops::direct::set_zmm(std::string(copy) == "avx512");
      const Passes got = run_passes(ops::cpu_backend_variant(copy), *pool, x, w, dy, dw0, g);
      ops::direct::set_zmm(zmm_before);
      for (const Tensor* t : {&got.y, &got.dx, &got.dw}) out[i].insert(out[i].end(), t->data<float>(), t->data<float>() + t->numel());
      ++i;
    }
    ASSERT_EQ(out[0].size(), out[1].size());
    EXPECT_EQ(std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(float)), 0) << name_of(c);
  }
}

}  // namespace

// The width choice of the CPU calibration (ops/cpu/tuning.h) from timings: each width keeps its
// best time over alternating rounds, and 512-bit wins only by the margin.
TEST(CpuTuning, TheWidthIsChosenByTheBestTimesWithAMargin) {
  auto fixed = [](double ymm, double zmm) {
    return [=](bool z) { return z ? zmm : ymm; };
  };
  EXPECT_TRUE(replica::ops::choose_direct_width(fixed(1.13, 1.0)).zmm) << "512-bit 1.13x: chosen";
  EXPECT_FALSE(replica::ops::choose_direct_width(fixed(0.94, 1.0)).zmm) << "512-bit 0.94x (Zen 4): not chosen";
  EXPECT_FALSE(replica::ops::choose_direct_width(fixed(1.02, 1.0)).zmm) << "within the 3% margin: the default";
  EXPECT_NEAR(replica::ops::choose_direct_width(fixed(1.13, 1.0)).ratio, 1.13, 1e-12);
  // A slow first call (a neighbour's burst) does not decide: the best of the rounds does.
  int calls = 0;
  auto noisy = [&](bool z) { return ++calls <= 2 ? 5.0 : (z ? 1.0 : 1.2); };
  const auto t = replica::ops::choose_direct_width(noisy, 3);
  EXPECT_EQ(calls, 6) << "3 rounds x 2 widths";
  EXPECT_TRUE(t.zmm);
  EXPECT_NEAR(t.ratio, 1.2, 1e-12);
}
