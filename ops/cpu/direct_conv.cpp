// Direct NHWC convolution: when it serves a geometry, and the filter packing (see direct_conv.h).
// The kernels themselves are part of the per-level CPU kernel copies (direct_kernels.cpp), so
// they are compiled and inlined with their level's flags; only the avx2 and avx512 copies have
// them.
#include "ops/cpu/direct_conv.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

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

namespace {
// REPLICA_WINOGRAD_TILE: 2 or 4 forces that output tile wherever Winograd serves; unset (0) is
// the measured choice.
int tile_from_env() {
  const char* v = std::getenv("REPLICA_WINOGRAD_TILE");
  if (!v || !*v) return 0;
  const std::string s(v);
  if (s == "2" || s == "4") return s[0] - '0';
  throw ConfigError("REPLICA_WINOGRAD_TILE=" + s + ": expected 2 or 4 (Winograd's output tile), or unset for the measured choice");
}
std::atomic<int>& forced_tile() {
  static std::atomic<int> m{tile_from_env()};
  return m;
}

// Winograd at all for this layer's data passes: 3x3, stride 1, padding 1, channels multiples of 8.
bool winograd_shape(const ConvGeom& g) {
  const int64_t pairs = g.C * g.K;
  return available() && winograd_enabled() && g.R == 3 && g.S == 3 && g.stride == 1 && g.pad == 1 &&
         g.C % 8 == 0 && g.K % 8 == 0 && pairs >= 16 * 16 && pairs <= 256 * 256;
}
}  // namespace

int set_winograd_tile(int m) {
  if (m != 0 && m != 2 && m != 4) throw ConfigError("Winograd output tile " + std::to_string(m) + ": expected 0, 2 or 4");
  return forced_tile().exchange(m);
}

// Measured per ResNet-20 and ResNet-50 layer (`replica_bench_model`, bench/RESULTS.md, "F(4x4,
// 3x3)"): F(4x4) 1.3-1.6x F(2x2)'s speed on every pass up to 128 x 128 channels (ResNet-20's
// 16-64, ResNet-50's 56 x 56 x 64 and 28 x 28 x 128), where F(2x2) had been 1.0-1.7x the direct
// kernels; at 256 x 256 (14 x 14: F(4x4)'s tiles cover 16 x 16, and its transformed filter, 36 C K
// floats = 9 MiB, leaves L3's share) F(2x2) is faster. At 512 x 512 (7 x 7) F(2x2)'s forward
// was 0.77x the direct kernel's: not served. The weight gradient takes the same tile: its
// per-thread transformed-domain partial ((m + 2)^2 C K floats, 4 MiB at 256 x 256) leaves L2, yet
// at ResNet-50's 128 and 256 channels it still ran 1.6-2.5x the direct kernel or the GEMM.
int winograd_tile(const ConvGeom& g) {
  if (!winograd_shape(g)) return 0;
  if (const int m = forced_tile().load(std::memory_order_relaxed)) return m;
  return g.C * g.K <= 128 * 128 ? 4 : 2;
}

bool serves_winograd(const ConvGeom& g) { return winograd_tile(g) != 0; }

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
