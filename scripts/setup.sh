#!/usr/bin/env bash
# One entry point for a fresh Debian machine: installs the packages replica needs that are
# missing, configures and builds, then either runs the default training job or the test suite.
#   scripts/setup.sh --run    install, build, and run `replica train` (the default config)
#   scripts/setup.sh --test   install, build with warnings as errors, run every test; then the
#                             sanitizer jobs: unit + integration under address/UB sanitizers
#                             (clang), each fuzz target briefly, the threaded tests under tsan
#   scripts/setup.sh          install and build only
# CUDA code is compiled whenever nvcc is found (CUDA at /usr/local/cuda or on PATH), GPU or not.
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-build}"
case "$mode" in --run|--test|build) ;; *) echo "usage: scripts/setup.sh [--run|--test]" >&2; exit 2 ;; esac

packages=(cmake ninja-build g++ pkg-config libeigen3-dev libcli11-dev libyaml-cpp-dev nlohmann-json3-dev googletest libgtest-dev
          libturbojpeg0-dev libpng-dev
          libbenchmark-dev zlib1g-dev libopenmpi-dev openmpi-bin dataset-fashion-mnist)
# The sanitizer and fuzz jobs of --test: Debian's clang with its libFuzzer runtime, bc for the fuzz table; slurm-wlm
# and munge for the Slurm recipe's test (tests/elastic/run_slurm.sh); dpkg-dev (dpkg-shlibdeps), file and fakeroot
# for the Debian package's test (tests/install/run.sh deb); binutils' objdump for the baseline check.
[ "$mode" = "--test" ] && packages+=(clang libclang-rt-14-dev bc slurm-wlm munge dpkg-dev file fakeroot binutils)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

jobs="$(nproc)"
phase() {  # name, then the command; prints how long each CI phase took
  local name="$1" t0=$SECONDS; shift
  echo "setup: == $name"
  "$@"
  echo "setup: == $name: $((SECONDS - t0)) s"
}
if [ "$mode" = "--test" ]; then
  phase "build (ci preset, warnings as errors)" cmake --preset ci
  phase "build" cmake --build build -j "$jobs"
  phase "tests" ctest --test-dir build --output-on-failure -j "$jobs" --timeout 600
  # Address + undefined-behaviour sanitizers (clang; the fuzz targets share the build): the unit
  # and integration labels (the mpi and gpu labels run in the normal build above). Trimmed for
  # time: the two tests that train on the real Fashion-MNIST for accuracy (10 and 5 minutes
  # under ASan on 2 cores) run in the normal build only; their code paths are the synthetic
  # runs' that stay in.
  phase "asan: configure" cmake --preset asan
  phase "asan: build" cmake --build build-asan -j "$jobs"
  phase "asan: unit + integration" env ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-asan --output-on-failure -j "$jobs" --timeout 900 -L "unit|integration" \
      -E "^(MixedPrecision.Fp16AndBf16TrackFp32OnFashionMnist|Cli.TrainsAndTheLossFallsThenEvaluates)$"
  phase "fuzz: every reader, 20000 executions each" tests/fuzz/run.sh 20000
  # Thread sanitizer on the code with threads in it: the host communicator, gradient sync,
  # replica groups (test_parallel), the multi-worker loader (test_data), the pool's lock (test_core)
  # and the trainer's replica threads with their collectives recorded and replayed (test_step_graph's
  # peer tests, and an abort that releases their graphs from another thread).
  phase "tsan: configure" cmake --preset tsan
  phase "tsan: build" cmake --build build-tsan -j "$jobs" --target test_parallel test_data test_core test_step_graph
  phase "tsan: communicator, gradient sync, replica group, loader, pool lock, replayed peers" env TSAN_OPTIONS=halt_on_error=1 \
    ctest --test-dir build-tsan --output-on-failure -j "$jobs" --timeout 900 -R "^(HostComm|GradientSync|ReplicaGroup|Solo|CommClique|AllReduce|Sizes/AllReduce|Sharding|Loader|Readers|SpinLock|MemoryPool.Concurrent|ShardedCollectives|Kinds/ShardedCollectives|ShardPlan|StepGraph.Peers|StepGraph.AnAbort|StepGraph.TrainerRunsOnTwoReplicas)"
elif [ "$mode" = "--run" ]; then
  cmake --preset default
  cmake --build build -j "$jobs" --target replica
  build/apps/replica train
else
  cmake --preset default
  cmake --build build -j "$jobs"
fi
