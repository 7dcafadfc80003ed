// make_pool: the pool for a device, over the right upstream (host pages or cudaMalloc), with the
// device kind's default mode (preallocate on GPUs, like JAX; growth on CPU, where preallocating
// 75% of the host's RAM per replica would starve the machine).
#pragma once
#include <memory>

#include "core/memory_pool.h"

namespace replica {

// Defaults for a device kind, then the environment (REPLICA_*) on top.
PoolOptions default_pool_options(DeviceKind kind);
std::unique_ptr<MemoryPool> make_pool(const Device& device, const PoolOptions& options);
// Host memory a device's input batches are assembled in before their copy: pinned (page-locked,
// so the copy runs at full bandwidth) for a GPU, growth mode; null for a CPU device, whose own
// pool is host memory already.
std::unique_ptr<MemoryPool> make_staging_pool(const Device& device);

}  // namespace replica
