// Pool factory: picks the upstream by device kind.
#include "core/pools.h"

#include "core/cuda/runtime.h"
#include "core/memory/shared_host_memory.h"

namespace replica {

PoolOptions default_pool_options(DeviceKind kind) {
  PoolOptions o;
  o.mode = kind == DeviceKind::cuda ? AllocatorMode::preallocate : AllocatorMode::growth;
  return pool_options_from_env(o);
}

std::unique_ptr<MemoryPool> make_pool(const Device& device, const PoolOptions& options) {
  std::unique_ptr<Upstream> up;
  if (device.kind == DeviceKind::cpu && options.shared_across_processes && options.mode != AllocatorMode::platform)
    up = std::make_unique<SharedHostUpstream>();
  else if (device.kind == DeviceKind::cpu)
    up = std::make_unique<HostUpstream>();
  else up = cuda::make_device_upstream(device);
  return std::make_unique<MemoryPool>(device, std::move(up), options);
}

std::unique_ptr<MemoryPool> make_staging_pool(const Device& device) {
  if (device.kind == DeviceKind::cpu) return nullptr;
  PoolOptions o;
  o.mode = AllocatorMode::growth;
  return std::make_unique<MemoryPool>(Device{DeviceKind::cpu, 0}, cuda::make_pinned_upstream(), o);
}

}  // namespace replica
