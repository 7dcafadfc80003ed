// CPU stream and the factory that picks the CPU or CUDA stream at run time.
#include "core/stream.h"

#include "core/cuda/runtime.h"
#include "core/errors.h"

namespace replica {
namespace {
class DoneEvent : public Event {
 public:
  void synchronize() override {}
  bool done() override { return true; }
};
}  // namespace

std::shared_ptr<Event> CpuStream::record() { return std::make_shared<DoneEvent>(); }

std::unique_ptr<Stream> make_stream(const Device& d) {
  if (d.kind == DeviceKind::cpu) return std::make_unique<CpuStream>(d);
  return cuda::make_cuda_stream(d);
}

namespace {
thread_local Stream* g_current = nullptr;
}
Stream* current_stream() { return g_current; }
void set_current_stream(Stream* s) { g_current = s; }

}  // namespace replica
