// The inner loops every host-side reduction shares: a block of partial sums (or maxima) plus one
// more rank's block, in f32; and the one-pass f32 sum of a range of every rank's buffer into
// every rank's buffer. Callers keep the rank order, so every rank gets the same bits.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstring>

namespace replica::parallel {

// acc = max(acc, s) or acc + s over m floats; the loops vectorise.
inline void accumulate(float* acc, const float* s, size_t m, bool max) {
  if (max)
    for (size_t i = 0; i < m; ++i) acc[i] = std::max(acc[i], s[i]);
  else
    for (size_t i = 0; i < m; ++i) acc[i] += s[i];
}

// For i in [off, off + n): out[r][i] = ((in[0][i] + in[1][i]) + ...) + in[R-1][i] for every r, then
// divided by R when `avg` (times 1/R when R is a power of two: exact, the same bits). in[r] may be
// out[r] (in place): each chunk is read from every input before it is written anywhere. One
// pass with the partial sums in registers, R loads and R stores per element; through an L1
// accumulator block (memcpy, accumulate, copy out) it was 3R - 1 loads and 2R stores, and 4
// ranks on 2 cores at 8 MiB ran at 0.62-0.75x memcpy against 0.81-0.92x now (bench/RESULTS.md).
// `outs` (default R) is how many of out[] receive the result: 1 for a reduce-scatter's owner.
inline void sum_to_all(const float* const* in, float* const* out, int R, size_t off, size_t n, bool avg,
                       int outs = -1) {
  if (outs < 0) outs = R;
  using F8 = float __attribute__((vector_size(32)));
  constexpr size_t kV = 4, kChunk = 8 * kV;  // four 8-float vectors: 32 floats, two cache lines
  const bool pow2 = (R & (R - 1)) == 0;
  const float inv = 1.f / static_cast<float>(R), fr = static_cast<float>(R);
  size_t i = off;
  const size_t end = off + n;
  for (; i + kChunk <= end; i += kChunk) {
    F8 v[kV], t;
    for (size_t k = 0; k < kV; ++k) std::memcpy(&v[k], in[0] + i + 8 * k, sizeof(F8));
    for (int r = 1; r < R; ++r)
      for (size_t k = 0; k < kV; ++k) {
        std::memcpy(&t, in[r] + i + 8 * k, sizeof(F8));
        v[k] += t;
      }
    if (avg)
      for (size_t k = 0; k < kV; ++k) v[k] = pow2 ? v[k] * inv : v[k] / fr;
    for (int r = 0; r < outs; ++r)
      for (size_t k = 0; k < kV; ++k) std::memcpy(out[r] + i + 8 * k, &v[k], sizeof(F8));
  }
  for (; i < end; ++i) {  // the tail, element by element in the same order
    float v = in[0][i];
    for (int r = 1; r < R; ++r) v += in[r][i];
    if (avg) v = pow2 ? v * inv : v / fr;
    for (int r = 0; r < outs; ++r) out[r][i] = v;
  }
}

}  // namespace replica::parallel
