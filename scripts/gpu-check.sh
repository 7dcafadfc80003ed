#!/usr/bin/env bash
# The GPU check, for any machine with an NVIDIA GPU: the gpu-labelled tests (pools, NCCL, the CUDA
# backend's conformance to the CPU one), the NCCL all-reduce benchmark, and ResNet-50 training
# throughput (synthetic 224x224, fp16 and bf16) beside PyTorch AMP channels_last on the same GPU
# in the same run. Prints each phase's time and writes a summary to $OUT/gpu-summary.txt when
# $OUT is set. Works from a bundle (scripts/gpu-bundle.sh, for machines without build tools: CUDA
# libraries come from the system or from Python's nvidia-* wheels) or from a source checkout with
# the build dependencies (it then builds build-gpu itself). Budget: under 8 minutes on one H200.
#   scripts/gpu-check.sh            (in a bundle folder or at the repository root)
# It cannot pass by accident: it exits non-zero when no GPU is visible, when any phase fails, and
# when any gpu test skips (except the checks that say they need two GPUs, listed as such). The
# summary's first line is the verdict: "GPU CHECK PASSED" or "GPU CHECK FAILED: <phases>".
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
summary="${OUT:-/tmp}/gpu-summary.txt"
body="$(mktemp)"
failed=()
log() { echo "$*" | tee -a "$body"; }
phase() {  # phase NAME SECONDS command...   (a failing phase is recorded, the check goes on)
  local name="$1" limit="$2"; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" 2>&1 | tee -a "$body" | tee "/tmp/phase-$name.log"
  local rc=${PIPESTATUS[0]}
  last_rc=$rc
  log "## phase '$name': exit $rc, $(( $(date +%s) - t0 )) s (limit $limit s)"
  [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}
# A GoogleTest phase: also fails when a test skipped, unless its skip says it needs two GPUs.
test_phase() {  # test_phase NAME SECONDS binary
  phase "$@"
  local name="$1" skips two
  # gtest prints a skip's message between "[ RUN ]" and "[  SKIPPED ] Name (N ms)".
  read -r skips two < <(awk '/^\[ RUN/ {msg = ""} {msg = msg $0 "\n"}
      /^\[  SKIPPED \] [A-Za-z].*\([0-9]+ ms\)/ {if (msg ~ /needs two GPUs/) two++; else skips++}
      END {print skips + 0, two + 0}' "/tmp/phase-$name.log")
  if [ "$skips" -gt "$two" ]; then
    failed+=("$name ($((skips - two)) test(s) skipped)")
    log "## phase '$name': $((skips - two)) test(s) skipped: nothing may skip on a GPU machine"
  fi
  [ "$two" -gt 0 ] && log "## phase '$name': $two check(s) need two GPUs and did not run here"
  return 0
}
finish() {  # the verdict first, then everything recorded
  local verdict="GPU CHECK PASSED"
  if [ ${#failed[@]} -gt 0 ]; then verdict="GPU CHECK FAILED: $(IFS=';'; echo "${failed[*]}")"; fi
  { echo "$verdict"; cat "$body"; } > "$summary"
  echo "$verdict"
  rm -f "$body"
  [ ${#failed[@]} -eq 0 ]
  exit $?
}
last_rc=0

if [ -d "$here/bin" ]; then
  bin="$here/bin"
  tests="$here/bin"
  root="$here"
  libs="$here/lib"
  # CUDA libraries (cuDNN, cuBLAS, NCCL) from Python's nvidia-* wheels when the system has none
  for d in $(python3 - <<'PY' 2>/dev/null
import glob, os, site
seen = set()
for sp in site.getsitepackages():
    for so in glob.glob(os.path.join(sp, "nvidia", "**", "lib*.so*"), recursive=True):
        seen.add(os.path.dirname(so))
print(" ".join(sorted(seen)))
PY
); do libs="$libs:$d"; done
  export LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}"
else
  root="$(cd "$here/.." && pwd)"
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d .)
  phase configure 300 cmake -S "$root" -B "$root/build-gpu" -G Ninja -DREPLICA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${arch:-90}"
  phase build 900 cmake --build "$root/build-gpu" -j "$(nproc)" --target replica test_core_gpu test_nccl test_cuda_conformance test_input_stager
  bin="$root/build-gpu/apps"
  tests="$root/build-gpu/tests"
fi
log "# replica gpu check on $(hostname), $(date -u)"
if ! nvidia-smi >> "$body" 2>&1; then
  failed+=("devices (nvidia-smi failed: no GPU or no driver)")
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>&1 | tee -a "$body"
[ -r /proc/driver/nvidia/version ] && head -1 /proc/driver/nvidia/version | tee -a "$body"
for b in "$bin/replica" "$tests/test_cuda_conformance"; do
  missing=$(ldd "$b" 2>/dev/null | grep "not found")
  [ -n "$missing" ] && { log "# $b cannot find: $missing"; failed+=("libraries ($b: $missing)"); }
done
# Which CUDA libraries the binaries resolved (files) and loaded (versions), and PyTorch's.
ldd "$bin/replica" 2>/dev/null | grep -E "libcudnn|libcublas|libnccl|libcudart" | tee -a "$body"
python3 -c "import torch; print('# torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version(), 'CUDA', torch.version.cuda)" 2>&1 | tee -a "$body"
# `replica devices` prints the driver, runtime, cuDNN, cuBLAS and NCCL versions actually loaded.
phase devices 30 "$bin/replica" devices --devices cuda
if ! grep -qE '^  cuda:[0-9]' /tmp/phase-devices.log; then
  failed+=("devices (no GPU visible to replica: $(grep -m1 'no GPU' /tmp/phase-devices.log))")
  log "# no GPU is visible: nothing below can pass"
  finish
fi
test_phase gpu-pool-tests 60 "$tests/test_core_gpu"
test_phase nccl-tests 60 "$tests/test_nccl"
test_phase input-stager 30 "$tests/test_input_stager"
test_phase conformance 150 "$tests/test_cuda_conformance"
# The command line end to end on the GPU: a short fp16 run of the default model on synthetic
# images (the GPU machine has no Fashion-MNIST), with evaluation, checkpoint and model file.
phase replica-train-gpu 90 "$bin/replica" train --devices cuda --run-dir /tmp/replica-gpu-run \
      --set data.dataset=synthetic --set "data.synthetic_shape=[28,28,1]" --set "data.mean=[0.5]" \
      --set "data.std=[0.25]" --set data.synthetic_size=12800 --set train.max_steps=100 --set train.precision=fp16
phase nccl-allreduce-bench 60 "$bin/replica" bench allreduce --devices cuda -b 8 -e 256M -f 4

# ResNet-50, one GPU, batch 256: replica and PyTorch AMP channels_last side by side.
cfg="$root/configs/resnet50_synthetic_gpu.yaml"
rate() { awk '!/^#/ && NF == 5 {print $3}' "/tmp/phase-$1.log" | tail -1; }
torch_rate() { sed -n 's/.*: \([0-9.]*\) img\/s.*/\1/p' "/tmp/phase-$1.log" | tail -1; }
have_torch=0
python3 -c "import torch, torchvision; assert torch.cuda.is_available()" 2>/dev/null && have_torch=1
for prec in fp16 bf16; do
  phase "replica-resnet50-$prec" 150 "$bin/replica" bench train "$cfg" --kind cuda --replicas 1 --steps 20 --warmup 5 \
        --set train.global_batch=256 --set train.micro_batch=256 --set train.precision=$prec
  if [ -z "$(rate "replica-resnet50-$prec")" ] && [ "$last_rc" != 124 ]; then  # failed fast: retry with cuDNN's heuristics
    REPLICA_CUDNN_ALGO=heuristic phase "replica-resnet50-$prec" 150 "$bin/replica" bench train "$cfg" --kind cuda \
        --replicas 1 --steps 20 --warmup 5 --set train.global_batch=256 --set train.micro_batch=256 --set train.precision=$prec
  fi
  if [ $have_torch = 1 ]; then
    phase "torch-resnet50-$prec" 120 python3 "$root/bench/anchors/torch_resnet50_amp.py" --dtype $prec --batch 256 --steps 20 --warmup 5
  fi
  r=$(rate "replica-resnet50-$prec"); t=$(torch_rate "torch-resnet50-$prec")
  if [ -n "$r" ] && [ -n "$t" ]; then
    log "# ResNet-50 $prec batch 256: replica $r img/s, PyTorch AMP channels_last $t img/s, ratio $(awk -v a="$r" -v b="$t" 'BEGIN{printf "%.2f", a/b}')x"
  else
    log "# ResNet-50 $prec: replica '${r:-none}' img/s, PyTorch '${t:-not run}' img/s"
  fi
  [ -n "$r" ] || failed+=("replica-resnet50-$prec (no throughput)")
done
log "# done"
finish
