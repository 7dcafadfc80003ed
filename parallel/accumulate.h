// The inner loop every host-side reduction shares: a block of partial sums (or maxima) plus one
// more rank's block, in f32. Callers keep the rank order, so every rank gets the same bits.
#pragma once
#include <algorithm>
#include <cstddef>

namespace replica::parallel {

// acc = max(acc, s) or acc + s over m floats; the loops vectorise.
inline void accumulate(float* acc, const float* s, size_t m, bool max) {
  if (max)
    for (size_t i = 0; i < m; ++i) acc[i] = std::max(acc[i], s[i]);
  else
    for (size_t i = 0; i < m; ++i) acc[i] += s[i];
}

}  // namespace replica::parallel
