// CUDA runtime pieces of core: device discovery, the cudaMalloc and pinned upstreams, streams,
// events and copies. A machine without a GPU gets an empty device list and a reason, not a crash.
#include <cuda_runtime.h>

#include <cstdio>
#include <memory>
#include <mutex>
#include <vector>

#include "core/cuda/check.h"
#include "core/cuda/device_guard.h"
#include "core/cuda/runtime.h"

namespace replica {

bool cuda_compiled() { return true; }

std::vector<DeviceInfo> cuda_devices(std::string* why) { return cuda::discover(why); }

namespace cuda {

namespace {
int runtime_get_device() {
  int d = 0;
  REPLICA_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}
void runtime_set_device(int d) { REPLICA_CUDA_CHECK(cudaSetDevice(d)); }
}  // namespace

const DeviceApi& runtime_device_api() {
  static const DeviceApi api{runtime_get_device, runtime_set_device};
  return api;
}

std::string runtime_versions() {
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  auto v = [](int x) { return x ? std::to_string(x / 1000) + "." + std::to_string(x % 1000 / 10) : std::string("none"); };
  return "CUDA driver " + v(driver) + ", runtime " + v(runtime) +
         (driver && runtime > driver ? " (the runtime is newer than the driver: no GPU will work)" : "");
}

std::vector<DeviceInfo> discover(std::string* why) {
  std::vector<DeviceInfo> out;
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    if (why) *why = std::string("no CUDA device is present: ") + cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error so later calls are not poisoned
    return out;
  }
  if (n == 0 && why) *why = "no CUDA device is present (cudaGetDeviceCount returned 0)";
  if (n == 0) return out;
  // cudaMemGetInfo needs each device current in turn; the caller's device is restored after.
  DeviceGuard restore(0);
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    DeviceInfo info;
    info.device = {DeviceKind::cuda, i};
    info.name = prop.name;
    char uuid[64];
    const unsigned char* u = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
    std::snprintf(uuid, sizeof uuid,
                  "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                  u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
                  u[14], u[15]);
    info.uuid = uuid;
    info.cc_major = prop.major;
    info.cc_minor = prop.minor;
    info.multiprocessors = prop.multiProcessorCount;
    info.total_memory = prop.totalGlobalMem;
    size_t free_b = 0, total_b = 0;
    if (cudaSetDevice(i) == cudaSuccess && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
      info.free_memory = free_b;
      info.total_memory = total_b;  // a MIG instance reports its slice here
    }
    out.push_back(info);
  }
  return out;
}

namespace {
class DeviceUpstream : public Upstream {
 public:
  explicit DeviceUpstream(int index) : index_(index) {
    DeviceGuard g(index_);
    size_t free_b = 0;
    REPLICA_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_));
  }
  void* allocate(size_t bytes) override {
    DeviceGuard g(index_);
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return p;
  }
  void deallocate(void* p, size_t) override {
    DeviceGuard g(index_);
    cudaFree(p);
  }
  size_t total_memory() const override { return total_; }
  std::string name() const override { return "cuda:" + std::to_string(index_); }

 private:
  int index_;
  size_t total_ = 0;
};

class PinnedUpstream : public Upstream {
 public:
  void* allocate(size_t bytes) override {
    void* p = nullptr;
    // Portable: pinned for every GPU's context, whichever thread allocates it (loader threads).
    if (cudaHostAlloc(&p, bytes, cudaHostAllocPortable) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return p;
  }
  void deallocate(void* p, size_t) override { cudaFreeHost(p); }
  size_t total_memory() const override { return host_physical_memory(); }
  std::string name() const override { return "pinned host"; }
};

// The events a stream recorded and its users have released, kept for the next record(): a
// micro-step records two (the input stager's), and creating each anew is a driver call per use.
class EventPool {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool() {
    DeviceGuard g(device_);
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
  }
  cudaEvent_t take() {
    {
      std::lock_guard<std::mutex> lock(m_);
      if (!free_.empty()) {
        cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    DeviceGuard g(device_);  // an event belongs to its stream's device
    cudaEvent_t e{};
    REPLICA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  void give(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(m_);
    free_.push_back(e);
  }

 private:
  int device_;
  std::mutex m_;
  std::vector<cudaEvent_t> free_;
};

class CudaEvent : public Event {
 public:
  explicit CudaEvent(std::shared_ptr<EventPool> pool) : pool_(std::move(pool)), e_(pool_->take()) {}
  ~CudaEvent() override { pool_->give(e_); }
  void synchronize() override { REPLICA_CUDA_CHECK(cudaEventSynchronize(e_)); }
  bool done() override { return cudaEventQuery(e_) == cudaSuccess; }
  std::shared_ptr<EventPool> pool_;  // outlives the event's stream when a user holds the event longer
  cudaEvent_t e_{};
};

class CudaStream : public Stream {
 public:
  explicit CudaStream(Device d) : device_(d), events_(std::make_shared<EventPool>(d.index)) {
    DeviceGuard g(d.index);
    REPLICA_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
  }
  ~CudaStream() override {
    // An event behind all of its work first: blocks freed later still wait for it (StreamToken).
    // cudaStreamDestroy returns at once and the device finishes the queued work regardless.
    retire();
    DeviceGuard g(device_.index);
    cudaStreamDestroy(s_);
  }
  const Device& device() const override { return device_; }
  void synchronize() override { REPLICA_CUDA_CHECK(cudaStreamSynchronize(s_)); }
  std::shared_ptr<Event> record() override {
    DeviceGuard g(device_.index);  // an event is recorded on its stream's device
    auto e = std::make_shared<CudaEvent>(events_);
    REPLICA_CUDA_CHECK(cudaEventRecord(e->e_, s_));
    return e;
  }
  void wait(Event& e) override {
    if (auto* ce = dynamic_cast<CudaEvent*>(&e)) REPLICA_CUDA_CHECK(cudaStreamWaitEvent(s_, ce->e_, 0));
    else e.synchronize();
  }
  void* native() const override { return s_; }

 private:
  Device device_;
  cudaStream_t s_{};
  std::shared_ptr<EventPool> events_;
};
}  // namespace

std::unique_ptr<Upstream> make_device_upstream(const Device& d) { return std::make_unique<DeviceUpstream>(d.index); }
std::unique_ptr<Upstream> make_pinned_upstream() { return std::make_unique<PinnedUpstream>(); }
std::unique_ptr<Stream> make_cuda_stream(const Device& d) { return std::make_unique<CudaStream>(d); }

namespace {
cudaStream_t native(Stream* stream) {
  if (!stream) stream = current_stream();
  return stream ? static_cast<cudaStream_t>(stream->native()) : nullptr;
}
}  // namespace

bool is_device_pointer(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

void copy(void* dst, const void* src, size_t bytes, Stream* stream) {
  if (bytes == 0) return;
  cudaStream_t s = native(stream);
  REPLICA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
  if (!is_device_pointer(dst) || !is_device_pointer(src)) REPLICA_CUDA_CHECK(cudaStreamSynchronize(s));
}

void copy_async(void* dst, const void* src, size_t bytes, Stream& stream) {
  if (bytes) REPLICA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, native(&stream)));
}

void memset_zero(void* p, size_t bytes, Stream* stream) {
  if (bytes) REPLICA_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, native(stream)));
}

void set_device(int index) { REPLICA_CUDA_CHECK(cudaSetDevice(index)); }

struct StreamTimer::Impl {
  cudaStream_t stream = nullptr;
  std::vector<cudaEvent_t> events;  // grows to the most marks a step made, then reused
  int used = 0;
};

StreamTimer::StreamTimer(Stream* stream) : impl_(std::make_unique<Impl>()) { impl_->stream = native(stream); }

StreamTimer::~StreamTimer() {
  for (cudaEvent_t e : impl_->events) cudaEventDestroy(e);
}

int StreamTimer::mark() {
  auto& m = *impl_;
  if (m.used == static_cast<int>(m.events.size())) {
    cudaEvent_t e{};
    REPLICA_CUDA_CHECK(cudaEventCreate(&e));  // with timing
    m.events.push_back(e);
  }
  REPLICA_CUDA_CHECK(cudaEventRecord(m.events[static_cast<size_t>(m.used)], m.stream));
  return m.used++;
}

void StreamTimer::synchronize() {
  if (impl_->used) REPLICA_CUDA_CHECK(cudaEventSynchronize(impl_->events[static_cast<size_t>(impl_->used - 1)]));
}

double StreamTimer::seconds(int from, int to) const {
  float ms = 0;
  REPLICA_CUDA_CHECK(cudaEventElapsedTime(&ms, impl_->events.at(static_cast<size_t>(from)),
                                          impl_->events.at(static_cast<size_t>(to))));
  return ms / 1000.0;
}

void StreamTimer::clear() { impl_->used = 0; }

struct CapturedGraph::Impl {
  cudaStream_t capturing = nullptr;  // set between begin() and end()
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  void drop() noexcept {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    exec = nullptr;
    graph = nullptr;
  }
};

CapturedGraph::CapturedGraph() : impl_(std::make_unique<Impl>()) {}
CapturedGraph::~CapturedGraph() {
  abandon();
  impl_->drop();
}

void CapturedGraph::begin(Stream& stream) {
  impl_->drop();
  cudaStream_t s = native(&stream);
  REPLICA_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  impl_->capturing = s;
}

void CapturedGraph::end() {
  auto& m = *impl_;
  if (!m.capturing) throw CudaError("CapturedGraph::end without begin");
  cudaGraph_t g = nullptr;
  const cudaError_t e = cudaStreamEndCapture(m.capturing, &g);
  m.capturing = nullptr;
  if (e != cudaSuccess) {
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();  // a capture's failure is not sticky; clear it for the eager work after
    throw CudaError(std::string("CUDA graph capture failed: ") + cudaGetErrorString(e));
  }
  m.graph = g;
  // Node priorities as captured: sync-BN's latency lane (a high-priority stream) keeps its
  // precedence over the gradient buckets in every replay, as it has eagerly. Without the flag a
  // replay launches every node at the graph's default priority.
  const cudaError_t ie = cudaGraphInstantiate(&m.exec, m.graph, cudaGraphInstantiateFlagUseNodePriority);
  if (ie != cudaSuccess) {
    m.exec = nullptr;
    m.drop();
    cudaGetLastError();
    throw CudaError(std::string("cudaGraphInstantiate failed: ") + cudaGetErrorString(ie));
  }
}

void CapturedGraph::abandon() noexcept {
  auto& m = *impl_;
  if (m.capturing) {
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(m.capturing, &g);
    if (g) cudaGraphDestroy(g);
    m.capturing = nullptr;
    cudaGetLastError();
  }
  m.drop();
}

void CapturedGraph::launch(Stream& stream) {
  if (!impl_->exec) throw CudaError("CapturedGraph::launch before a successful capture");
  REPLICA_CUDA_CHECK(cudaGraphLaunch(impl_->exec, native(&stream)));
}

bool CapturedGraph::ready() const { return impl_->exec != nullptr; }

size_t CapturedGraph::nodes() const {
  size_t n = 0;
  if (impl_->graph) cudaGraphGetNodes(impl_->graph, nullptr, &n);
  return n;
}

}  // namespace cuda
}  // namespace replica
