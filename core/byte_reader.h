// ByteReader: reads little-endian fields and spans out of bytes that came from outside (a file),
// checking every length against the bytes that remain before use, with arithmetic that cannot
// wrap. Every reader of a file format goes through it, so no crafted length field can send a
// read past the end; a short or lying file is an IoError naming the source and the field.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

#include "core/errors.h"

namespace replica {

class ByteReader {
 public:
  ByteReader(std::string_view bytes, std::string source) : b_(bytes), source_(std::move(source)) {}

  size_t offset() const { return off_; }
  size_t remaining() const { return b_.size() - off_; }
  size_t size() const { return b_.size(); }
  const std::string& source() const { return source_; }

  // Throws unless `n` more bytes are there (n compared with what remains: no `off + n` overflow).
  void need(uint64_t n, const std::string& what) const {
    if (n > remaining())
      throw IoError(source_ + ": truncated in " + what + " (needs " + std::to_string(n) + " bytes at offset " +
                    std::to_string(off_) + ", the file has " + std::to_string(b_.size()) + ")");
  }

  template <typename T>
  T get(const std::string& what) {
    static_assert(std::is_trivially_copyable_v<T>);
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, b_.data() + off_, sizeof(T));
    off_ += sizeof(T);
    return v;
  }

  // The next n bytes, as a view into the buffer.
  std::string_view take(uint64_t n, const std::string& what) {
    need(n, what);
    std::string_view v = b_.substr(off_, static_cast<size_t>(n));
    off_ += static_cast<size_t>(n);
    return v;
  }

  // n elements of `elem` bytes each: the product is checked before it is formed.
  std::string_view take_array(uint64_t n, size_t elem, const std::string& what) {
    if (elem != 0 && n > remaining() / elem)
      throw IoError(source_ + ": truncated in " + what + ": " + std::to_string(n) + " elements of " +
                    std::to_string(elem) + " bytes do not fit in the " + std::to_string(remaining()) +
                    " bytes left of the file");
    return take(n * elem, what);
  }

 private:
  std::string_view b_;
  std::string source_;
  size_t off_ = 0;
};

}  // namespace replica
