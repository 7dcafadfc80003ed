// CPU feature checks and the kernels' instruction-set level (see the header), each answered once.
#include "core/cpu_features.h"

#include <cstdlib>
#include <cstring>

#include "core/device.h"
#include "core/errors.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define REPLICA_X86_FEATURES 1
#endif

namespace replica {

#ifdef REPLICA_X86_FEATURES
bool cpu_has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
bool cpu_has_fma() {
  static const bool yes = __builtin_cpu_supports("fma");
  return yes;
}
bool cpu_has_f16c() {
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;  // cpuid leaf 1: F16C is ECX bit 29
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) && __builtin_cpu_supports("avx");
  }();
  return yes;
}
namespace {
// libgcc's / compiler-rt's cpu model checks XCR0 too, so "avx2" and "avx512f" are false where
// the operating system does not save the ymm / zmm registers.
bool has_v3() {
  // MOVBE (cpuid 1 ECX bit 22) and LZCNT (0x80000001 ECX bit 5) by cpuid: clang 14's
  // __builtin_cpu_supports does not know "movbe".
  unsigned a = 0, b = 0, c = 0, d = 0;
  const bool movbe = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_MOVBE);
  const bool lzcnt = __get_cpuid(0x80000001u, &a, &b, &c, &d) && (c & bit_LZCNT);
  return cpu_has_avx2() && cpu_has_fma() && cpu_has_f16c() && __builtin_cpu_supports("bmi") &&
         __builtin_cpu_supports("bmi2") && movbe && lzcnt;
}
bool has_v4() {
  return has_v3() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl");
}
}  // namespace
bool cpu_isa_supported(CpuIsa isa) {
  static const bool v3 = has_v3(), v4 = has_v4();
  return isa == CpuIsa::baseline || (isa == CpuIsa::avx2 && v3) || (isa == CpuIsa::avx512 && v4);
}
#else
bool cpu_has_avx2() { return false; }
bool cpu_has_fma() { return false; }
bool cpu_has_f16c() { return false; }
bool cpu_isa_supported(CpuIsa isa) { return isa == CpuIsa::baseline; }
#endif

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::baseline: return "baseline";
    case CpuIsa::avx2: return "avx2";
    case CpuIsa::avx512: return "avx512";
  }
  return "?";
}

const char* cpu_isa_features(CpuIsa isa) {
  switch (isa) {
#ifdef __x86_64__
    case CpuIsa::baseline: return "x86-64-v2: SSE4.2, POPCNT";
#else
    case CpuIsa::baseline: return "the build's own target";
#endif
    case CpuIsa::avx2: return "x86-64-v3: AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE";
    case CpuIsa::avx512: return "x86-64-v4: AVX-512 F, BW, CD, DQ, VL";
  }
  return "?";
}

CpuIsa cpu_isa_best() {
  for (CpuIsa isa : {CpuIsa::avx512, CpuIsa::avx2})
    if (cpu_isa_supported(isa)) return isa;
  return CpuIsa::baseline;
}

namespace {
struct Allowed {
  CpuIsa isa = CpuIsa::baseline;
  std::string forced;  // REPLICA_CPU_ISA's value, when set
  std::string error;   // why the value cannot be used
};
const Allowed& allowed() {
  static const Allowed a = [] {
    Allowed r;
    r.isa = cpu_isa_best();
    const char* v = std::getenv("REPLICA_CPU_ISA");
    if (!v || !*v) return r;
    r.forced = v;
    const std::string have = std::string("this CPU supports up to ") + cpu_isa_name(r.isa) + " (" +
                             cpu_isa_features(r.isa) + ")";
    for (CpuIsa isa : {CpuIsa::baseline, CpuIsa::avx2, CpuIsa::avx512}) {
      if (r.forced != cpu_isa_name(isa)) continue;
      if (!cpu_isa_supported(isa)) {
        r.error = "REPLICA_CPU_ISA=" + r.forced + ": " + have + "; set baseline" +
                  (r.isa >= CpuIsa::avx2 ? std::string(" or avx2") : std::string()) + ", or unset it";
      } else {
        r.isa = isa;
      }
      return r;
    }
    r.error = "REPLICA_CPU_ISA='" + r.forced + "' is not a level: use baseline, avx2 or avx512 (" + have +
              "), or unset it for the best";
    return r;
  }();
  return a;
}
}  // namespace

CpuIsa cpu_isa_allowed() {
  const Allowed& a = allowed();
  if (!a.error.empty()) throw ConfigError(a.error);
  return a.isa;
}

bool cpu_isa_enabled(CpuIsa isa) {
  const Allowed& a = allowed();
  return isa == CpuIsa::baseline || (a.error.empty() && isa <= a.isa);
}

std::string cpu_isa_report() {
  const Allowed& a = allowed();
  if (!a.error.empty()) return "unusable: " + a.error;
  std::string s = cpu_isa_name(a.isa);
  s += " (";
  if (!a.forced.empty()) s += "REPLICA_CPU_ISA=" + a.forced + "; ";
  s += std::string("this CPU supports up to ") + cpu_isa_name(cpu_isa_best()) + ")";
  return s;
}

std::string cpu_model_key() {
  const std::string name = cpu_device_info(0).name;
#ifdef REPLICA_X86_FEATURES
  unsigned a = 0, b = 0, c = 0, d = 0;
  char vendor[13] = {};
  if (__get_cpuid(0, &a, &b, &c, &d)) {
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
  }
  if (__get_cpuid(1, &a, &b, &c, &d)) {
    // Family and model with their extended fields, as the vendors' manuals combine them.
    unsigned family = (a >> 8) & 0xf, model = (a >> 4) & 0xf;
    const unsigned stepping = a & 0xf;
    if (family == 0xf) family += (a >> 20) & 0xff;
    if (family == 0x6 || family >= 0xf) model += ((a >> 16) & 0xf) << 4;
    return std::string(vendor) + " family " + std::to_string(family) + " model " + std::to_string(model) +
           " stepping " + std::to_string(stepping) + " (" + name + ")";
  }
#endif
  return name;
}

}  // namespace replica
