// Memory settings: names, the capacity rule, the environment overrides.
#include "core/memory/options.h"

#include <cstdlib>

#include "core/env.h"
#include "core/errors.h"
#include "core/memory/resource.h"
#include "core/units.h"

namespace replica {

const char* allocator_mode_name(AllocatorMode m) {
  switch (m) {
    case AllocatorMode::preallocate: return "preallocate";
    case AllocatorMode::growth: return "growth";
    case AllocatorMode::platform: return "platform";
  }
  return "?";
}

AllocatorMode parse_allocator_mode(const std::string& s, const std::string& what) {
  if (s == "preallocate") return AllocatorMode::preallocate;
  if (s == "growth") return AllocatorMode::growth;
  if (s == "platform") return AllocatorMode::platform;
  throw ConfigError(what + ": '" + s + "' is not an allocator mode; use preallocate, growth or platform");
}

void validate_fraction(double f, const std::string& what) {
  if (!(f > 0.0 && f <= 1.0))
    throw ConfigError(what + ": " + std::to_string(f) +
                      " is not a memory fraction; use a number in (0, 1], e.g. 0.75");
}

size_t pool_capacity(const PoolOptions& o, size_t total, const std::string& device_name) {
  if (o.bytes > total)
    throw ConfigError("memory.bytes: " + format_bytes(o.bytes) + " is more than " + device_name + " has (" +
                      format_bytes(total) + "); use a smaller size or memory.fraction");
  if (!o.bytes) validate_fraction(o.fraction, "memory.fraction (" + o.fraction_source + ")");
  const size_t cap = o.bytes ? o.bytes : static_cast<size_t>(static_cast<double>(total) * o.fraction);
  return cap & ~(kMemoryGranularity - 1);
}

PoolOptions pool_options_from_env(PoolOptions o, const char* (*getenv_fn)(const char*)) {
  auto get = [&](const char* name) -> const char* { return getenv_fn ? getenv_fn(name) : std::getenv(name); };
  if (const char* v = get("REPLICA_PREALLOCATE")) {
    const auto b = parse_bool_text(v);
    if (!b)
      throw ConfigError("REPLICA_PREALLOCATE='" + std::string(v) +
                        "' is not a boolean; use true or false (false = grow on demand)");
    o.mode = *b ? AllocatorMode::preallocate : AllocatorMode::growth;
    o.mode_source = "REPLICA_PREALLOCATE";
  }
  if (const char* v = get("REPLICA_ALLOCATOR")) {
    const std::string s = v;
    if (s == "platform") {
      o.mode = AllocatorMode::platform;
    } else if (s == "bfc" || s == "default" || s == "pool") {
      if (o.mode == AllocatorMode::platform) o.mode = AllocatorMode::growth;
    } else {
      throw ConfigError("REPLICA_ALLOCATOR='" + s +
                        "' is not an allocator; use default (the pool) or platform "
                        "(every allocation straight from the device, for debugging)");
    }
    o.mode_source = "REPLICA_ALLOCATOR";
  }
  if (const char* v = get("REPLICA_MEM_FRACTION")) {
    char* end = nullptr;
    const double f = std::strtod(v, &end);
    if (end == v || *end != '\0')
      throw ConfigError("REPLICA_MEM_FRACTION='" + std::string(v) +
                        "' is not a number; use a fraction in (0, 1], e.g. 0.75");
    if (!(f > 0.0 && f <= 1.0))
      throw ConfigError("REPLICA_MEM_FRACTION='" + std::string(v) +
                        "' is not a memory fraction; use a number in (0, 1], e.g. 0.75");
    o.fraction = f;
    o.fraction_source = "REPLICA_MEM_FRACTION";
  }
  return o;
}

}  // namespace replica
