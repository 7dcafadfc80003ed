// What this CPU can run, asked once at run time: the kernels that use AVX2, FMA or F16C are
// compiled with target attributes (so a portable -march=x86-64 build carries them) and entered
// only when these say so. false on anything but x86-64 with GCC or Clang.
#pragma once

namespace replica {

bool cpu_has_avx2();
bool cpu_has_fma();
bool cpu_has_f16c();  // with AVX, which its 256-bit forms need

}  // namespace replica
