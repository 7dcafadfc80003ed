// FNV-1a 64 over bytes: the checksum of model files and checkpoint sections, and the fingerprint
// replicas compare to prove their parameters agree. The offset basis is the standard one
// (14695981039346656037), so any outside reader following the format documents agrees.
// Files written before 2026-12 (checkpoint format 1, model files RPLM0001) used a basis with a
// digit missing (1469598103934665603); they are still read, with kFnv1aLegacyBasis.
#pragma once
#include <cstddef>
#include <cstdint>

namespace replica {

constexpr uint64_t kFnv1aBasis = 14695981039346656037ull;
constexpr uint64_t kFnv1aPrime = 1099511628211ull;
constexpr uint64_t kFnv1aLegacyBasis = 1469598103934665603ull;

inline uint64_t fnv1a(const void* data, size_t n, uint64_t h = kFnv1aBasis) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * kFnv1aPrime;
  return h;
}

}  // namespace replica
