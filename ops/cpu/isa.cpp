// The table of compiled CPU kernel copies and the choice among them (see isa.h). Compiled once,
// for the baseline; the defines REPLICA_CPU_VARIANT_<name> say which copies the build made.
#include "ops/cpu/isa.h"

#include <cstdlib>

#include "core/errors.h"

namespace replica::ops {

#define REPLICA_DECLARE_VARIANT(ns) \
  namespace ns {                    \
  Backend& cpu_backend();           \
  CpuIsa cpu_backend_isa();         \
  }
#ifdef REPLICA_CPU_VARIANT_native
REPLICA_DECLARE_VARIANT(isa_native)
#endif
#ifdef REPLICA_CPU_VARIANT_baseline
REPLICA_DECLARE_VARIANT(isa_baseline)
#endif
#ifdef REPLICA_CPU_VARIANT_avx2
REPLICA_DECLARE_VARIANT(isa_avx2)
#endif
#ifdef REPLICA_CPU_VARIANT_avx512
REPLICA_DECLARE_VARIANT(isa_avx512)
#endif
#undef REPLICA_DECLARE_VARIANT

const std::vector<CpuKernelVariant>& cpu_kernel_variants() {
  static const std::vector<CpuKernelVariant> all = {
#ifdef REPLICA_CPU_VARIANT_native
      {"native", isa_native::cpu_backend_isa(), &isa_native::cpu_backend},
#endif
#ifdef REPLICA_CPU_VARIANT_baseline
      {"baseline", isa_baseline::cpu_backend_isa(), &isa_baseline::cpu_backend},
#endif
#ifdef REPLICA_CPU_VARIANT_avx2
      {"avx2", isa_avx2::cpu_backend_isa(), &isa_avx2::cpu_backend},
#endif
#ifdef REPLICA_CPU_VARIANT_avx512
      {"avx512", isa_avx512::cpu_backend_isa(), &isa_avx512::cpu_backend},
#endif
  };
  return all;
}

namespace {
std::string built_names() {
  std::string s;
  for (const auto& v : cpu_kernel_variants()) s += (s.empty() ? "" : ", ") + std::string(v.name);
  return s;
}

const CpuKernelVariant& choose() {
  const CpuIsa allowed = cpu_isa_allowed();  // throws on an unusable REPLICA_CPU_ISA
  const auto& all = cpu_kernel_variants();
  if (all.size() == 1 && std::string(all[0].name) == "native") {
    if (allowed != cpu_isa_best())
      throw ConfigError(std::string("REPLICA_CPU_ISA=") + cpu_isa_name(allowed) +
                        ": this build has one copy of the CPU kernels, compiled with -march=native "
                        "(REPLICA_NATIVE=ON); unset REPLICA_CPU_ISA, or build without REPLICA_NATIVE for "
                        "the portable build that carries every level");
    return all[0];
  }
  const CpuKernelVariant* pick = nullptr;
  for (const auto& v : all)
    if (v.isa <= allowed) pick = &v;
  if (!pick || pick->isa != allowed) {
    // A forced level must be the level that runs; the best level may be one this build lacks
    // (REPLICA_CPU_VARIANTS without avx512), and the next lower copy serves.
    const char* forced = std::getenv("REPLICA_CPU_ISA");
    if ((forced && *forced) || !pick)
      throw ConfigError(std::string("REPLICA_CPU_ISA=") + cpu_isa_name(allowed) +
                        ": this build has no copy of the CPU kernels for that level (built: " + built_names() +
                        "); choose one of those, or unset it");
  }
  return *pick;
}
}  // namespace

const CpuKernelVariant& cpu_kernel_variant() {
  static const CpuKernelVariant& v = choose();
  return v;
}

Backend& cpu_backend_variant(const std::string& name) {
  for (const auto& v : cpu_kernel_variants()) {
    if (name != v.name) continue;
    if (!cpu_isa_supported(v.isa))
      throw ConfigError("CPU kernels '" + name + "': this CPU supports up to " + cpu_isa_name(cpu_isa_best()));
    return v.backend();
  }
  throw ConfigError("CPU kernels '" + name + "': not in this build (built: " + built_names() + ")");
}

std::string cpu_kernel_report() {
  try {
    const CpuKernelVariant& v = cpu_kernel_variant();
    return std::string(v.name) + " (" + cpu_isa_features(v.isa) + "); built: " + built_names() + "; level " +
           cpu_isa_report();
  } catch (const ConfigError& e) {
    return std::string("unusable: ") + e.what() + " (built: " + built_names() + ")";
  }
}

}  // namespace replica::ops
