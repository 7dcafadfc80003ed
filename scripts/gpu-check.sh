#!/usr/bin/env bash
# The GPU check, for any machine with an NVIDIA GPU: runs the gpu-labelled tests and the NCCL
# all-reduce benchmark, printing each phase's time, and writes a summary to $OUT/gpu-summary.txt
# when $OUT is set. Works from a bundle (scripts/gpu-bundle.sh, for machines without build
# tools: CUDA libraries are taken from the system or from Python's nvidia-* wheels) or from a
# source checkout with the build dependencies (it then builds build-gpu itself).
#   scripts/gpu-check.sh            (in a bundle folder or at the repository root)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
summary="${OUT:-/tmp}/gpu-summary.txt"
: > "$summary"
log() { echo "$*" | tee -a "$summary"; }
phase() {
  local name="$1"; shift
  local t0=$(date +%s)
  "$@" 2>&1 | tee -a "$summary"
  local rc=${PIPESTATUS[0]}
  log "## phase '$name': exit $rc, $(( $(date +%s) - t0 )) s"
}

if [ -d "$here/bin" ]; then
  bin="$here/bin"
  libs="$here/lib"
  # CUDA libraries from Python wheels when the system has none
  for d in $(python3 -c 'import site,glob; print(" ".join(glob.glob(site.getsitepackages()[0]+"/nvidia/*/lib")))' 2>/dev/null); do
    libs="$libs:$d"
  done
  export LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}"
else
  root="$(cd "$here/.." && pwd)"
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d .)
  phase build cmake -S "$root" -B "$root/build-gpu" -G Ninja -DREPLICA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${arch:-90}"
  phase build2 cmake --build "$root/build-gpu" -j "$(nproc)" --target replica test_core_gpu test_nccl
  bin="$root/build-gpu/apps"
  cp "$root/build-gpu/tests/test_core_gpu" "$root/build-gpu/tests/test_nccl" "$bin/" 2>/dev/null
fi
log "# replica gpu check on $(hostname), $(date -u)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$summary"
phase devices "$bin/replica" devices --devices cuda
phase gpu-pool-tests "$bin/test_core_gpu"
phase nccl-tests "$bin/test_nccl"
phase nccl-allreduce-bench "$bin/replica" bench allreduce --devices cuda -b 8 -e 256M -f 4
log "# not yet run here: ResNet-50 training on GPU (the CUDA op backend is not written yet)"
