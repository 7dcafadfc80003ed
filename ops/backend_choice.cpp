// The run-time choice of backend for a device: the one place that names the implementations
// (ops/cpu/, ops/cuda/, the recorder a captured step needs), a floor above them, so that the
// interface (ops/backend.h, backend.cpp) depends on none of them.
#include "ops/backend.h"
#include "ops/cpu/isa.h"
#include "ops/cuda/cuda_backend.h"
#include "ops/recording_backend.h"

namespace replica::ops {

Backend& backend_for(const Device& d) {
  if (d.kind == DeviceKind::cpu) {
    // The kernels chosen once (ops/cpu/isa.h), behind the recorder a captured step needs.
    static RecordingBackend cpu(cpu_kernel_variant().backend());
    return cpu;
  }
  return cuda_backend();
}

}  // namespace replica::ops
