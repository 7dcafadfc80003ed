#!/usr/bin/env bash
# A portable build runs on any x86-64-v2 CPU: outside the CPU kernel copies chosen at run time
# (ops/cpu/isa.h), no function of the binary may use an instruction above the baseline. Reads the
# disassembly of BINARY and lists every function that uses a VEX / EVEX instruction (AVX and up:
# v-prefixed mnemonics, ymm / zmm / mask registers) or a BMI / LZCNT / MOVBE one, unless its
# demangled name carries the level it was compiled for (avx2, avx512, f16c: the copies'
# namespaces isa_avx2 / replica_eigen_avx2 ..., and the target-attribute functions named so).
# That catches an inline function of a higher copy that the linker kept for everyone. A local
# clone the compiler made ("[clone .isra.0]", no level in its name) passes when every function
# that calls or jumps to it carries a level (or is such a clone). tzcnt is allowed: it is
# encoded as rep bsf, which older CPUs run as bsf (GCC emits it for __builtin_ctz everywhere).
#   tests/isa/check_baseline_isa.sh BINARY
set -euo pipefail
bin="$1"
command -v objdump >/dev/null || { echo "objdump not found (binutils)"; exit 77; }
objdump -d -C --no-show-raw-insn "$bin" | awk '
  # Functions are told apart by address: local clones of one name exist once per copy.
  /^[0-9a-f]+ <.*>:$/ { fn = substr($0, index($0, "<") + 1); sub(/>:$/, "", fn)
                        fa = $1; name[fa] = fn; next }
  NF >= 2 && fn != "" {
    line = $0; sub(/^[ \t]*[0-9a-f]+:[ \t]*/, "", line)
    split(line, w, /[ \t]+/); m = w[1]
    if (m ~ /^(rep|repz|repnz|lock|notrack|bnd|data16|cs|ds|addr32)$/) m = w[2]
    high = (m ~ /^v/ && m !~ /^(verr|verw)$/) || line ~ /%[yz]mm[0-9]/ || line ~ /%k[0-7]/ ||
           m ~ /^(andn|bextr|blsi|blsmsk|blsr|bzhi|mulx|pdep|pext|rorx|sarx|shlx|shrx|lzcnt|movbe)$/
    if (high && fn !~ /avx2|avx512|f16c/ && !(fa in seen)) { seen[fa] = m; order[++n] = fa }
    if (m ~ /^(call|jmp|j[a-z]+)$/ && w[2] ~ /^[0-9a-f]+$/) {
      target = sprintf("%016s", w[2]); gsub(/ /, "0", target)
      if (target != fa) callers[target] = callers[target] SUBSEP fa
    }
  }
  function leveled(a,   k, list, i) {  # named with a level, or a clone only such code reaches
    if (name[a] ~ /avx2|avx512|f16c/) return 1
    if (name[a] !~ /\[clone \./ || (a in visiting) || !(a in callers)) return 0
    visiting[a] = 1
    k = split(substr(callers[a], 2), list, SUBSEP)
    for (i = 1; i <= k; ++i) if (!leveled(list[i])) { delete visiting[a]; return 0 }
    delete visiting[a]
    return 1
  }
  END {
    bad = 0
    for (i = 1; i <= n; ++i) {
      if (leveled(order[i])) continue
      printf "  %s  (first: %s)\n", name[order[i]], seen[order[i]]; ++bad
    }
    if (bad > 0) { printf "%d function(s) above the baseline outside the dispatched kernels\n", bad; exit 1 }
    print "no instruction above the baseline outside the dispatched kernels"
  }'
