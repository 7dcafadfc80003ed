// FNV-1a over bytes: the checksum of model files and checkpoint sections, and the fingerprint
// replicas compare to prove their parameters agree.
#pragma once
#include <cstddef>
#include <cstdint>

namespace replica {

inline uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace replica
