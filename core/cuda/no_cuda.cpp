// Built instead of core/cuda/runtime.cu when CUDA is off: no devices, and a clear error if a
// CUDA device is asked for anyway.
#include "core/cuda/device_guard.h"
#include "core/cuda/runtime.h"
#include "core/errors.h"

namespace replica {

bool cuda_compiled() { return false; }

std::vector<DeviceInfo> cuda_devices(std::string* why) { return cuda::discover(why); }

namespace cuda {
namespace {
[[noreturn]] void not_built() {
  throw CudaError("this replica was built without CUDA; rebuild with -DREPLICA_CUDA=ON on a "
                  "machine with the CUDA toolkit, or use --devices cpu:N");
}
}  // namespace

std::string runtime_versions() { return "CUDA: not built"; }
std::vector<DeviceInfo> discover(std::string* why) {
  if (why) *why = "replica was built without CUDA (-DREPLICA_CUDA=OFF or no nvcc found)";
  return {};
}
std::unique_ptr<Upstream> make_device_upstream(const Device&) { not_built(); }
std::unique_ptr<Upstream> make_pinned_upstream() { not_built(); }
std::unique_ptr<Stream> make_cuda_stream(const Device&) { not_built(); }
void copy(void*, const void*, size_t, Stream*) { not_built(); }
void copy_async(void*, const void*, size_t, Stream&) { not_built(); }
void memset_zero(void*, size_t, Stream*) { not_built(); }
void set_device(int) { not_built(); }
bool is_device_pointer(const void*) { return false; }
struct StreamTimer::Impl {};
StreamTimer::StreamTimer(Stream*) { not_built(); }
StreamTimer::~StreamTimer() = default;
int StreamTimer::mark() { not_built(); }
void StreamTimer::synchronize() { not_built(); }
double StreamTimer::seconds(int, int) const { not_built(); }
void StreamTimer::clear() {}
struct CapturedGraph::Impl {};
CapturedGraph::CapturedGraph() = default;
CapturedGraph::~CapturedGraph() = default;
void CapturedGraph::begin(Stream&) { not_built(); }
void CapturedGraph::end() { not_built(); }
void CapturedGraph::abandon() noexcept {}
void CapturedGraph::launch(Stream&) { not_built(); }
bool CapturedGraph::ready() const { return false; }
size_t CapturedGraph::nodes() const { return 0; }
const DeviceApi& runtime_device_api() {
  static const DeviceApi api{[]() -> int { not_built(); }, [](int) { not_built(); }};
  return api;
}

}  // namespace cuda
}  // namespace replica
