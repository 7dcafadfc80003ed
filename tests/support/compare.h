// Test support: how far two parameter vectors are apart, relative to the larger's scale.
#pragma once
#include <algorithm>
#include <cmath>
#include <vector>

namespace replica::testing {

// max |a - b| / max |b|
inline double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 1e-12;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    d = std::max(d, static_cast<double>(std::abs(a[i] - b[i])));
    m = std::max(m, static_cast<double>(std::abs(b[i])));
  }
  return d / m;
}

}  // namespace replica::testing
