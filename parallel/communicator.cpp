// The Communicator's default uneven (ZeRO) collectives, written once over the even ones.
#include "parallel/communicator.h"

#include <algorithm>
#include <cstring>

#include "core/errors.h"

namespace replica::parallel {

void Communicator::check_bounds(const char* what, size_t count, const std::vector<size_t>& bounds) const {
  bool ok = bounds.size() == static_cast<size_t>(size()) + 1 && bounds.front() == 0 && bounds.back() == count;
  for (size_t r = 1; ok && r < bounds.size(); ++r) ok = bounds[r - 1] <= bounds[r];
  if (!ok)
    throw CommError(std::string(what) + ": rank " + std::to_string(rank()) + " passed " +
                    std::to_string(bounds.size()) + " bounds for " + std::to_string(size()) +
                    " ranks over " + std::to_string(count) +
                    " elements; they must be size() + 1 non-decreasing offsets from 0 to count");
}

void Communicator::reduce_scatter_v_by_all_reduce(void* data, size_t count, DType dtype, ReduceOp op,
                                                  const std::vector<size_t>& bounds) {
  check_bounds("reduce_scatter_v", count, bounds);
  if (device_buffers())
    throw CommError(name() + ": reduce_scatter_v on device buffers needs the communicator's own implementation");
  // The whole message reduced in a copy, then this rank's range kept: the bits of all_reduce.
  const size_t es = dtype_size(dtype);
  std::vector<char> tmp(static_cast<const char*>(data), static_cast<const char*>(data) + count * es);
  all_reduce(tmp.data(), count, dtype, op);
  const size_t lo = bounds[rank()], hi = bounds[rank() + 1];
  std::memcpy(static_cast<char*>(data) + lo * es, tmp.data() + lo * es, (hi - lo) * es);
}

void Communicator::all_gather_v_by_all_gather(void* data, size_t count, DType dtype,
                                              const std::vector<size_t>& bounds) {
  check_bounds("all_gather_v", count, bounds);
  if (device_buffers())
    throw CommError(name() + ": all_gather_v on device buffers needs the communicator's own implementation");
  // Every range padded to the longest, gathered evenly, then copied into place.
  const size_t es = dtype_size(dtype);
  const int R = size();
  size_t most = 0;
  for (int r = 0; r < R; ++r) most = std::max(most, bounds[r + 1] - bounds[r]);
  if (most == 0) return all_gather(nullptr, nullptr, 0, dtype);  // still a collective on every rank
  std::vector<char> send(most * es, 0), recv(most * es * R);
  const size_t lo = bounds[rank()], hi = bounds[rank() + 1];
  std::memcpy(send.data(), static_cast<const char*>(data) + lo * es, (hi - lo) * es);
  all_gather(send.data(), recv.data(), most, dtype);
  for (int r = 0; r < R; ++r)
    if (r != rank())
      std::memcpy(static_cast<char*>(data) + bounds[r] * es, recv.data() + r * most * es, (bounds[r + 1] - bounds[r]) * es);
}

WorkHandle Communicator::reduce_scatter_v_async(void* data, size_t count, DType dtype, ReduceOp op,
                                                const std::vector<size_t>& bounds) {
  reduce_scatter_v_by_all_reduce(data, count, dtype, op, bounds);
  return std::make_shared<DoneWork>();
}

WorkHandle Communicator::all_gather_v_async(void* data, size_t count, DType dtype, const std::vector<size_t>& bounds) {
  all_gather_v_by_all_gather(data, count, dtype, bounds);
  return std::make_shared<DoneWork>();
}

}  // namespace replica::parallel
