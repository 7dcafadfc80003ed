// Tensor: a typed, shaped view into a block of a device's pool (NHWC for images). Views share
// the block through a reference count and cost nothing; the block returns to its pool when the
// last view goes.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/memory_pool.h"
#include "core/shape.h"

namespace replica {

class Stream;

// One pool block (or external memory when pool is null).
class Storage {
 public:
  Storage(MemoryPool* pool, size_t bytes, MemTag tag);
  Storage(MemoryPool* pool, size_t bytes, MemTag tag, Stream* stream);  // for `stream`'s work
  Storage(void* external, size_t bytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  MemTag tag() const { return tag_; }
  const Device& device() const { return device_; }
  MemoryPool* pool() const { return pool_; }

 private:
  MemoryPool* pool_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  MemTag tag_ = MemTag::other;
  Device device_;
};

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(MemoryPool& pool, Shape shape, DType dtype, MemTag tag);
  // A block for `stream`'s work rather than the thread's current stream (MemoryPool::allocate).
  static Tensor empty(MemoryPool& pool, Shape shape, DType dtype, MemTag tag, Stream* stream);
  // Zero-filled (on a GPU in the thread's current stream).
  static Tensor zeros(MemoryPool& pool, Shape shape, DType dtype, MemTag tag);
  // A non-owning tensor over memory the caller keeps alive.
  static Tensor wrap(void* data, Shape shape, DType dtype, Device device);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[i]; }
  int64_t numel() const { return shape_.numel(); }
  DType dtype() const { return dtype_; }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  const Device& device() const { return storage_->device(); }
  MemTag tag() const { return storage_->tag(); }
  // The pool the block came from (nullptr for wrapped memory).
  MemoryPool* pool() const { return storage_ ? storage_->pool() : nullptr; }
  void* raw() const { return static_cast<char*>(storage_->data()) + offset_; }
  template <typename T>
  T* data() const {
    return static_cast<T*>(raw());
  }
  // A view of `shape` starting `elem_offset` elements in; must stay inside the block.
  Tensor view(int64_t elem_offset, Shape shape) const;
  Tensor reshape(Shape shape) const;
  std::string str() const;  // "f32[128,28,28,1]@cpu:0"

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;  // bytes
  Shape shape_;
  DType dtype_ = DType::f32;
};

// Copies src into dst (same byte size): host<->host memcpy, anything with a GPU through CUDA on
// `stream` (default: the thread's current stream), finished on return when a side is host memory.
void copy_tensor(const Tensor& src, const Tensor& dst, Stream* stream = nullptr);

// Host round trips that work for a tensor on any device (checkpoints, model files, tests).
std::string tensor_to_bytes(const Tensor& t);
void tensor_from_bytes(const Tensor& t, const void* data, size_t bytes);
// The elements as f32 on the host (any float dtype).
std::vector<float> host_floats(const Tensor& t);
// src itself when it already lives in `pool`, else a copy into it (host batches to a GPU).
Tensor to_pool(const Tensor& src, MemoryPool& pool, MemTag tag);

}  // namespace replica
