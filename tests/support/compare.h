// Test support: how far two vectors are apart, relative to the reference's scale, in a way that
// cannot be fooled by non-finite values (std::max(d, NaN) keeps d, so a naive loop reads an
// all-NaN result as a perfect match).
#pragma once
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace replica::testing {

// max |a - b| / max(max |b|, floor). Infinite when the sizes differ, or when an element is
// non-finite on one side only or differs in kind (NaN vs inf, +inf vs -inf): every such result is
// a failure of any tolerance.
inline double rel_diff(const float* a, const float* b, size_t n, double floor = 1e-12) {
  constexpr double kFail = std::numeric_limits<double>::infinity();
  double d = 0, m = floor;
  for (size_t i = 0; i < n; ++i) {
    const bool fa = std::isfinite(a[i]), fb = std::isfinite(b[i]);
    if (fa != fb) return kFail;
    if (!fa) {  // both non-finite: the same kind passes (an expected inf), any other does not
      if (std::isnan(a[i]) != std::isnan(b[i]) || (!std::isnan(a[i]) && a[i] != b[i])) return kFail;
      continue;
    }
    d = std::max(d, static_cast<double>(std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i]))));
    m = std::max(m, static_cast<double>(std::abs(b[i])));
  }
  return d / m;
}

inline double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b, double floor = 1e-12) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  return rel_diff(a.data(), b.data(), a.size(), floor);
}

// True when every value is finite (a result the comparison is about must be).
inline bool all_finite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

}  // namespace replica::testing
