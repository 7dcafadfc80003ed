// Shape: up to 4 dimensions (NHWC for images), with element counts and printing.
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/errors.h"

namespace replica {

class Shape {
 public:
  static constexpr int kMaxRank = 4;
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) {
    if (dims.size() > kMaxRank) throw ShapeError("Shape: rank > 4 is not supported");
    for (int64_t d : dims) {
      if (d < 0) throw ShapeError("Shape: negative dimension " + std::to_string(d));
      dims_[rank_++] = d;
    }
  }
  int rank() const { return rank_; }
  int64_t operator[](int i) const { return dims_[i]; }
  int64_t& operator[](int i) { return dims_[i]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < rank_; ++i) n *= dims_[i];
    return n;
  }
  bool operator==(const Shape& o) const {
    if (rank_ != o.rank_) return false;
    for (int i = 0; i < rank_; ++i)
      if (dims_[i] != o.dims_[i]) return false;
    return true;
  }
  bool operator!=(const Shape& o) const { return !(*this == o); }
  std::string str() const {
    std::string s = "[";
    for (int i = 0; i < rank_; ++i) s += (i ? "," : "") + std::to_string(dims_[i]);
    return s + "]";
  }

 private:
  std::array<int64_t, kMaxRank> dims_{};
  int rank_ = 0;
};

}  // namespace replica
