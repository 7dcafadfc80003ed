// What to change when a replica's pool runs out of memory, in the terms of the run configuration
// (micro-batch, precision, gradient checkpointing, memory.*). The trainer installs it on every
// replica's pool (MemoryPool::set_oom_advice), so core/ names no training setting.
#pragma once
#include <string>

#include "core/memory_pool.h"

namespace replica::train {

std::string memory_advice(const OomReport& r);

}  // namespace replica::train
