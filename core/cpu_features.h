// What this CPU can run, asked once at run time, and which instruction-set level the CPU kernels
// use. The default build is portable (host code for x86-64-v2); the hot kernels are compiled once
// per level (ops/cpu/isa.h) and one copy is chosen here at start-up, like PyTorch's DispatchStub
// or oneDNN's ISA dispatch. REPLICA_CPU_ISA=baseline|avx2|avx512 forces a lower level.
#pragma once
#include <string>

namespace replica {

bool cpu_has_avx2();
bool cpu_has_fma();
bool cpu_has_f16c();  // with AVX, which its 256-bit forms need

// Instruction-set levels of the CPU kernels, lowest first (compare with <, >=).
//   baseline: x86-64-v2 (SSE4.2, POPCNT), or the build's own target off x86-64
//   avx2:     x86-64-v3 (AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE): Haswell, Zen 1 and later
//   avx512:   x86-64-v4 (AVX-512 F, BW, CD, DQ, VL): Skylake-SP, Ice Lake, Sapphire Rapids, Zen 4
enum class CpuIsa { baseline = 0, avx2 = 1, avx512 = 2 };

const char* cpu_isa_name(CpuIsa isa);
// "x86-64-v3: AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE"
const char* cpu_isa_features(CpuIsa isa);
// This CPU (and its operating system, for the AVX and AVX-512 register state) can run `isa`.
bool cpu_isa_supported(CpuIsa isa);
// The highest level this CPU supports.
CpuIsa cpu_isa_best();
// The level the kernels may use: REPLICA_CPU_ISA when set, else cpu_isa_best(). Read once; an
// unknown value, or a level this CPU lacks, is a ConfigError naming the variable, the value and
// what this CPU has (thrown on every call, so the first caller reports it).
CpuIsa cpu_isa_allowed();
// cpu_isa_allowed() >= isa, without throwing (an unusable REPLICA_CPU_ISA allows only baseline):
// for code outside the kernels that has its own AVX2 / F16C paths (16-bit conversions).
bool cpu_isa_enabled(CpuIsa isa);
// "avx2 (this CPU supports up to avx2)" or "baseline (REPLICA_CPU_ISA=baseline; this CPU ...)"
std::string cpu_isa_report();
// This CPU's model as CPUID names it: "GenuineIntel family 6 model 143 stepping 8 (Intel(R)
// Xeon(R) Platinum 8480+)": the key under which per-CPU measurements are kept (ops/cpu/tuning.h).
// Off x86-64: the model name of /proc/cpuinfo.
std::string cpu_model_key();

}  // namespace replica
