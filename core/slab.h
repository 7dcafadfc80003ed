// Slab<T>: records of one type (the pool's blocks, its live entries) from slabs recycled
// through a free list, so serving an allocation never calls malloc. Not thread safe: the pool
// uses it under its mutex.
#pragma once
#include <cstddef>
#include <memory>
#include <vector>

namespace replica::detail {

// Records of type T from slabs of 256, recycled through a free list (never returned to the
// system before the Slab itself goes). get() leaves the record as it was last used.
template <typename T>
class Slab {
 public:
  T* get() {
    if (spare_.empty()) {
      slabs_.emplace_back(new T[kSlab]);
      for (size_t i = 0; i < kSlab; ++i) spare_.push_back(&slabs_.back()[i]);
    }
    T* t = spare_.back();
    spare_.pop_back();
    return t;
  }
  void put(T* t) { spare_.push_back(t); }

 private:
  static constexpr size_t kSlab = 256;
  std::vector<std::unique_ptr<T[]>> slabs_;
  std::vector<T*> spare_;
};

}  // namespace replica::detail
