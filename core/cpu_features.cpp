// CPU feature checks (see the header), each answered once and kept.
#include "core/cpu_features.h"

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
#else
bool cpu_has_avx2() { return false; }
bool cpu_has_fma() { return false; }
bool cpu_has_f16c() { return false; }
#endif

}  // namespace replica
