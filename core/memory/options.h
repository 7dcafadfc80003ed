// How a device's memory is set up: the mode (preallocate, growth, platform), the capacity
// (`bytes`, else `fraction x total`: the one place this rule lives), and the environment
// variables that override them (JAX's XLA_PYTHON_CLIENT_* counterparts).
#pragma once
#include <cstddef>
#include <string>

namespace replica {

enum class AllocatorMode { preallocate, growth, platform };
const char* allocator_mode_name(AllocatorMode m);
AllocatorMode parse_allocator_mode(const std::string& s, const std::string& what);

struct PoolOptions {
  AllocatorMode mode = AllocatorMode::growth;
  double fraction = 0.75;   // of the device's total memory: the preallocated region or the limit
  size_t bytes = 0;         // absolute capacity; overrides fraction when non-zero
  size_t growth_initial = size_t(2) << 20;  // first region in growth mode (doubles after)
  // Host regions from memfds that the job's other processes on this machine can map
  // (core/memory/shared_host_memory.h); set by ReplicaGroup under mpirun. Not in platform mode,
  // where every tensor is its own region.
  bool shared_across_processes = false;
  // Where each setting came from, for error messages ("REPLICA_MEM_FRACTION", "memory.fraction").
  std::string mode_source = "default", fraction_source = "default";
};

// The pool's capacity on a device of `total` bytes: `bytes` when set, else fraction x total,
// rounded down to the pool's granularity. Throws ConfigError for a fraction outside (0, 1] or
// bytes beyond the device (naming the setting and `device_name`).
size_t pool_capacity(const PoolOptions& o, size_t total, const std::string& device_name = "the device");

// Applies REPLICA_PREALLOCATE, REPLICA_MEM_FRACTION, REPLICA_ALLOCATOR over `base`. An invalid
// value throws ConfigError naming the variable and what it accepts. `getenv` is injectable.
PoolOptions pool_options_from_env(PoolOptions base, const char* (*getenv_fn)(const char*) = nullptr);
void validate_fraction(double f, const std::string& what);

}  // namespace replica
