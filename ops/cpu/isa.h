// Which copy of the CPU kernels this process runs. The kernels are compiled once per
// instruction-set level the build carries (REPLICA_CPU_VARIANTS; one "native" copy in a
// REPLICA_NATIVE=ON build); the highest one the CPU supports and REPLICA_CPU_ISA allows is
// chosen on first use and kept for the life of the process.
#pragma once
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "ops/backend.h"

namespace replica::ops {

// One compiled copy: its name ("baseline", "avx2", "avx512", or "native"), the level its flags
// reach, and its backend.
struct CpuKernelVariant {
  const char* name;
  CpuIsa isa;
  Backend& (*backend)();
};

// Every copy in this build, lowest level first.
const std::vector<CpuKernelVariant>& cpu_kernel_variants();
// The copy in use: the highest whose level this CPU supports and REPLICA_CPU_ISA allows.
// ConfigError when REPLICA_CPU_ISA cannot be honoured (unknown, above this CPU, or a level this
// build has no copy of), naming the value and what to set instead.
const CpuKernelVariant& cpu_kernel_variant();
// The CPU backend of one copy (tests compare them); ConfigError when this CPU cannot run it.
Backend& cpu_backend_variant(const std::string& name);
// For --version and `replica devices`: "avx2 (x86-64-v3: ...); built: baseline, avx2, avx512;
// this CPU supports up to avx2".
std::string cpu_kernel_report();

}  // namespace replica::ops
