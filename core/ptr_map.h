// PtrMap: an open-addressing hash map from block address to its bookkeeping, for the pool's
// deallocate lookup. Linear probing with backward-shift deletion (no tombstones), so lookups stay
// short under any alloc/free churn and no call touches the system allocator except to grow.
#pragma once
#include <cstdint>
#include <vector>

namespace replica::detail {

template <typename V>
class PtrMap {
 public:
  PtrMap() : slots_(1024) {}
  size_t size() const { return size_; }

  void insert(const void* key, V value) {
    if ((size_ + 1) * 4 > slots_.size() * 3) grow();
    size_t i = index(key);
    while (slots_[i].key) i = (i + 1) & mask();
    slots_[i] = {key, value};
    size_++;
  }
  // Returns the value and removes the key; `found` says whether it was there.
  V take(const void* key, bool& found) {
    size_t i = index(key);
    while (slots_[i].key && slots_[i].key != key) i = (i + 1) & mask();
    found = slots_[i].key != nullptr;
    if (!found) return V{};
    V v = slots_[i].value;
    // backward-shift: move later entries of the probe run into the hole
    size_t hole = i;
    for (size_t j = (i + 1) & mask(); slots_[j].key; j = (j + 1) & mask()) {
      size_t home = index(slots_[j].key);
      if (((j - home) & mask()) >= ((j - hole) & mask())) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = {};
    size_--;
    return v;
  }
  template <typename F>
  void for_each(F&& f) const {
    for (auto& s : slots_)
      if (s.key) f(s.key, s.value);
  }

 private:
  struct Slot {
    const void* key = nullptr;
    V value{};
  };
  size_t mask() const { return slots_.size() - 1; }
  size_t index(const void* key) const {
    uint64_t x = reinterpret_cast<uintptr_t>(key) >> 8;  // blocks are 256-byte aligned
    x *= 0x9e3779b97f4a7c15ull;
    return static_cast<size_t>(x >> 20) & mask();
  }
  void grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(old.size() * 2, Slot{});
    size_ = 0;
    for (auto& s : old)
      if (s.key) insert(s.key, s.value);
  }
  std::vector<Slot> slots_;
  size_t size_ = 0;
};

}  // namespace replica::detail
