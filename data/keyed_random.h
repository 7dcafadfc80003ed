// The loader's one source of randomness: draws that are a pure function of a 64-bit key (SplitMix64),
// keys derived from (seed, epoch, index) by the same mixing, so every augmentation, crop, policy
// and mix is reproducible whatever the thread timing, replica count or resume point.
#pragma once
#include <cstdint>

namespace replica::data {

class KeyedRandom {
 public:
  explicit KeyedRandom(uint64_t key) : s_(key) {}
  // SplitMix64's step on one value: a well-mixed 64-bit hash, for deriving keys.
  static uint64_t hash(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  }
  uint64_t next() {  // SplitMix64: advance the state, mix it
    const uint64_t z = s_;
    s_ += 0x9e3779b97f4a7c15ull;
    return hash(z);
  }
  double uniform(double lo, double hi) {  // [lo, hi)
    return lo + (hi - lo) * static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0);
  }
  int64_t integer(int64_t lo, int64_t hi) {  // [lo, hi]
    return lo + static_cast<int64_t>(next() % static_cast<uint64_t>(hi - lo + 1));
  }

 private:
  uint64_t s_;
};

}  // namespace replica::data
