// The CUDA parts of core, declared without CUDA headers so plain C++ can call them. Built from
// core/cuda/*.cu when CUDA is on; core/cuda/no_cuda.cpp supplies versions that say CUDA is not
// built when it is off.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "core/captured_work.h"
#include "core/device.h"
#include "core/memory_pool.h"
#include "core/stream.h"

namespace replica::cuda {

// "CUDA driver 13.0 (supports runtime up to), runtime 13.0": what this process loaded.
std::string runtime_versions();
// Visible devices; empty (with the reason in *why) when none.
std::vector<DeviceInfo> discover(std::string* why);
// cudaMalloc / cudaFree on one device; total_memory is the device's total (not free) memory.
std::unique_ptr<Upstream> make_device_upstream(const Device& d);
// Pinned host memory (cudaMallocHost) for staging copies.
std::unique_ptr<Upstream> make_pinned_upstream();
std::unique_ptr<Stream> make_cuda_stream(const Device& d);
// Copies between host and device memory (or device to device) on `stream` (the thread's current
// stream when null). Returns after the copy when either side is host memory, so the host may read
// or reuse it; device-to-device copies stay asynchronous in stream order.
void copy(void* dst, const void* src, size_t bytes, Stream* stream);
// The same without waiting: the caller keeps both sides alive (pinned host memory) until an event
// recorded on `stream` after it has passed.
void copy_async(void* dst, const void* src, size_t bytes, Stream& stream);
// Zero-fills device memory in stream order.
void memset_zero(void* p, size_t bytes, Stream* stream);
// Makes `index` the calling thread's current device.
void set_device(int index);
// True when `p` points into device memory (false for host and pinned memory).
bool is_device_pointer(const void* p);

// Marks on a stream timed by the device (timing CUDA events): what the GPU spent between two points
// of a step, without the host waiting at each (a host read at every mark would serialise the
// host's launches with the kernels and time both). mark() records on `stream` (the thread's
// current stream when null); after synchronize(), seconds(i, j) is the device time from mark i to
// mark j. clear() forgets the marks, keeping the events for reuse.
class StreamTimer {
 public:
  explicit StreamTimer(Stream* stream = nullptr);
  ~StreamTimer();
  StreamTimer(const StreamTimer&) = delete;
  StreamTimer& operator=(const StreamTimer&) = delete;
  int mark();  // the mark's index
  void synchronize();
  double seconds(int from, int to) const;
  void clear();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A CUDA graph of the work one thread queues on a stream between begin() and end()
// (cudaStreamBeginCapture in thread-local mode: other threads' CUDA calls go on as usual), replayed
// by launch() on that stream: the same kernels with the same arguments and addresses, for one
// launch's host cost. Nothing runs while capturing, and everything the captured work touches must
// stay where it was for as long as the graph is replayed (train.cuda_graph keeps it in a private
// pool).
class CapturedGraph final : public CapturedWork {
 public:
  CapturedGraph();
  ~CapturedGraph() override;
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  void begin(Stream& stream) override;
  // Ends the capture and instantiates the graph; throws CudaError, the capture dropped, when the
  // captured work did something a graph cannot hold (a host wait, a new allocation, another
  // stream's event).
  void end() override;
  // After a failure between begin() and end(): ends the capture if one is open and drops it.
  void abandon() noexcept override;
  void launch(Stream& stream) override;
  bool ready() const override;
  size_t nodes() const override;  // kernels, copies and memsets in the graph

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace replica::cuda
