// Tensor and Storage: pool-backed blocks and zero-cost views.
#include "core/tensor.h"

#include <cstring>

#include "core/captured_work.h"
#include "core/cuda/runtime.h"
#include "core/errors.h"

namespace replica {

Storage::Storage(MemoryPool* pool, size_t bytes, MemTag tag)
    : pool_(pool), bytes_(bytes), tag_(tag), device_(pool->device()) {
  data_ = pool_->allocate(bytes, tag);
}
Storage::Storage(MemoryPool* pool, size_t bytes, MemTag tag, Stream* stream)
    : pool_(pool), bytes_(bytes), tag_(tag), device_(pool->device()) {
  data_ = pool_->allocate(bytes, tag, stream);
}
Storage::Storage(void* external, size_t bytes, Device device)
    : data_(external), bytes_(bytes), device_(device) {}
Storage::~Storage() {
  if (pool_) pool_->deallocate(data_);
}

Tensor Tensor::empty(MemoryPool& pool, Shape shape, DType dtype, MemTag tag) {
  Tensor t;
  size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  t.storage_ = std::make_shared<Storage>(&pool, bytes, tag);
  t.shape_ = shape;
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::empty(MemoryPool& pool, Shape shape, DType dtype, MemTag tag, Stream* stream) {
  Tensor t;
  size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  t.storage_ = std::make_shared<Storage>(&pool, bytes, tag, stream);
  t.shape_ = shape;
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::zeros(MemoryPool& pool, Shape shape, DType dtype, MemTag tag) {
  Tensor t = empty(pool, shape, dtype, tag);
  if (pool.device().kind == DeviceKind::cpu) {
    if (CallRecording* r = call_recording())  // the recorded work zeroes it (core/captured_work.h)
      r->add([p = t.raw(), n = t.nbytes()] { std::memset(p, 0, n); });
    else
      std::memset(t.raw(), 0, t.nbytes());
  } else cuda::memset_zero(t.raw(), t.nbytes(), nullptr);
  return t;
}

Tensor Tensor::wrap(void* data, Shape shape, DType dtype, Device device) {
  Tensor t;
  size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  t.storage_ = std::make_shared<Storage>(data, bytes, device);
  t.shape_ = shape;
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::view(int64_t elem_offset, Shape shape) const {
  size_t off = offset_ + static_cast<size_t>(elem_offset) * dtype_size(dtype_);
  size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype_);
  if (elem_offset < 0 || off + bytes > storage_->bytes())
    throw ShapeError("Tensor::view: " + shape.str() + " at element " + std::to_string(elem_offset) +
                     " runs past the end of a block of " + std::to_string(storage_->bytes()) + " bytes");
  Tensor t = *this;
  t.offset_ = off;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  if (shape.numel() != numel())
    throw ShapeError("Tensor::reshape: " + shape_.str() + " has " + std::to_string(numel()) +
                     " elements, " + shape.str() + " has " + std::to_string(shape.numel()));
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

std::string Tensor::str() const {
  std::string s = dtype_name(dtype_);
  s += shape_.str();
  s += '@';
  s += storage_ ? device().str() : std::string("none");
  return s;
}

void copy_tensor(const Tensor& src, const Tensor& dst, Stream* stream) {
  if (src.nbytes() != dst.nbytes())
    throw ShapeError("copy_tensor: " + src.str() + " and " + dst.str() + " differ in size");
  if (src.device().kind == DeviceKind::cpu && dst.device().kind == DeviceKind::cpu) {
    if (CallRecording* r = call_recording())
      r->add([d = dst.raw(), s = src.raw(), n = src.nbytes()] { std::memmove(d, s, n); });
    else
      std::memmove(dst.raw(), src.raw(), src.nbytes());
    return;
  }
  cuda::copy(dst.raw(), src.raw(), src.nbytes(), stream);
}

std::string tensor_to_bytes(const Tensor& t) {
  std::string out(t.nbytes(), '\0');
  recording_refuses("tensor_to_bytes");
  if (t.device().kind == DeviceKind::cpu) std::memcpy(out.data(), t.raw(), out.size());
  else cuda::copy(out.data(), t.raw(), out.size(), nullptr);
  return out;
}

void tensor_from_bytes(const Tensor& t, const void* data, size_t bytes) {
  if (bytes != t.nbytes())
    throw ShapeError("tensor_from_bytes: " + std::to_string(bytes) + " bytes for " + t.str() + " (" +
                     std::to_string(t.nbytes()) + " bytes)");
  recording_refuses("tensor_from_bytes");
  if (t.device().kind == DeviceKind::cpu) std::memcpy(t.raw(), data, bytes);
  else cuda::copy(t.raw(), data, bytes, nullptr);
}

std::vector<float> host_floats(const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  std::string b = tensor_to_bytes(t);
  convert(b.data(), t.dtype(), out.data(), DType::f32, out.size());
  return out;
}

Tensor to_pool(const Tensor& src, MemoryPool& pool, MemTag tag) {
  if (src.pool() == &pool) return src;
  Tensor dst = Tensor::empty(pool, src.shape(), src.dtype(), tag);
  copy_tensor(src, dst);
  return dst;
}

}  // namespace replica
