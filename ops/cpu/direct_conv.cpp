// Direct NHWC convolution: when it serves a geometry, and the filter packing (see direct_conv.h).
// The kernels themselves are part of the per-level CPU kernel copies (direct_kernels.cpp), so
// they are compiled and inlined with their level's flags; only the avx2 and avx512 copies have
// them.
#include "ops/cpu/direct_conv.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "core/cpu_features.h"
#include "core/env.h"
#include "core/errors.h"

namespace replica::ops::direct {

namespace {
// AVX2 + FMA present and allowed (REPLICA_CPU_ISA=baseline turns the kernel off too; false off
// x86-64).
bool cpu_has_avx2_fma() { return cpu_isa_enabled(CpuIsa::avx2); }
std::atomic<bool>& enabled() {
  static std::atomic<bool> on{env_flag("REPLICA_DIRECT_CONV", true)};
  return on;
}
}  // namespace

bool available() { return cpu_has_avx2_fma() && enabled().load(std::memory_order_relaxed); }

bool set_enabled(bool on) { return enabled().exchange(on) && cpu_has_avx2_fma(); }

namespace {
std::atomic<bool>& zmm() {
  static std::atomic<bool> on{env_flag("REPLICA_DIRECT_ZMM", false)};
  return on;
}
}  // namespace

bool zmm_enabled() { return zmm().load(std::memory_order_relaxed); }

bool set_zmm(bool on) { return zmm().exchange(on); }

namespace {
std::atomic<bool>& winograd() {
  static std::atomic<bool> on{env_flag("REPLICA_WINOGRAD", true)};
  return on;
}
}  // namespace

bool winograd_enabled() { return winograd().load(std::memory_order_relaxed); }

bool set_winograd(bool on) { return winograd().exchange(on); }

// Measured per ResNet-20 layer (`replica_bench_model`, bench/RESULTS.md): 1.35-1.4x the direct
// kernel's forward and backward data at 32 x 32 and 64 x 64 channels, 1.2x its weight gradient;
// at 16 x 16 1.1-1.5x once the tile loops lost their per-tile divisions and bounds checks (the
// whole ResNet-20 step 1.02-1.07x with it); smaller pairs were not measured (no model here has
// them). On ResNet-50's (batch 16): forward and backward data 1.76x at 64 x 64 channels
// (56 x 56), 1.7x at 128 x 128, 1.5x at 256 x 256; at 512 x 512 (7 x 7, 16 tiles an image, a 16 MiB transformed filter) forward 0.77x: not served.
bool serves_winograd(const ConvGeom& g) {
  const int64_t pairs = g.C * g.K;
  return available() && winograd_enabled() && g.R == 3 && g.S == 3 && g.stride == 1 && g.pad == 1 &&
         g.C % 8 == 0 && g.K % 8 == 0 && pairs >= 16 * 16 && pairs <= 256 * 256;
}

// The weight gradient keeps a transformed-domain partial (16 C K floats) that every block of
// tiles loads and stores: above 64 x 64 channels it leaves L2 and the direct kernel or the GEMM
// serve instead.
bool serves_winograd_filter(const ConvGeom& g) { return serves_winograd(g) && g.C * g.K <= 64 * 64; }

bool serves_forward(const ConvGeom& g) { return available() && g.K % 8 == 0; }

bool serves_backward_data(const ConvGeom& g) {
  return available() && g.stride == 1 && g.R == g.S && g.pad < g.R && g.C % 8 == 0;
}

// Measured per ResNet-20 and ResNet-50 layer (bench/RESULTS.md): the direct weight gradient wins
// on every layer with at most 64 input and output channels (up to 3x the GEMM on ResNet-20's)
// and, since it works a band of output rows at a time, on the wide layers with at least 28 x 28
// output pixels too (1.0-1.6x); on wide layers with small outputs (14 x 14, 7 x 7) it loses up to
// 1.6x (each image's accumulators are loaded and stored for few pixels), so those keep im2col.
bool serves_backward_filter(const ConvGeom& g) {
  return available() && g.K % 8 == 0 && ((g.K <= 64 && g.C <= 64) || g.P * g.Q >= 28 * 28);
}

namespace {
// Filter (i = tap (r, s, c), k) in the kernels' layout: blocks of 16 output channels (the last 8
// when K = 16 m + 8), each block's taps x channels contiguous, so one block's filter streams
// from one place while it is reused for every pixel of an image.
template <typename At>
void pack_blocks(int64_t taps, int64_t K, float* out, At at) {
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    const int64_t kw = std::min<int64_t>(16, K - k0);
    float* blk = out + k0 * taps;
    for (int64_t i = 0; i < taps; ++i)
      for (int64_t k = 0; k < kw; ++k) blk[i * kw + k] = at(i, k0 + k);
  }
}
}  // namespace

void pack_forward(const float* w, float* out, const ConvGeom& g) {
  const int64_t RSC = g.R * g.S * g.C;
  pack_blocks(RSC, g.K, out, [&](int64_t i, int64_t k) { return w[k * RSC + i]; });
}

void pack_backward_data(const float* w, float* out, const ConvGeom& g) {
  // Tap (r', s', k) of the flipped filter, output channel c: w[k][R-1-r'][S-1-s'][c].
  pack_blocks(g.R * g.S * g.K, g.C, out, [&](int64_t i, int64_t c) {
    const int64_t k = i % g.K, s = (i / g.K) % g.S, r = i / (g.K * g.S);
    return w[((k * g.R + (g.R - 1 - r)) * g.S + (g.S - 1 - s)) * g.C + c];
  });
}

}  // namespace replica::ops::direct
