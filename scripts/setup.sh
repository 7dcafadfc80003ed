#!/usr/bin/env bash
# One entry point for a fresh Debian machine: installs the packages replica needs that are
# missing, configures and builds, then either runs the default training job or the test suite.
#   scripts/setup.sh --run    install, build, and run `replica train` (the default config)
#   scripts/setup.sh --test   install, build with warnings as errors, and run every test
#   scripts/setup.sh          install and build only
# CUDA code is compiled whenever nvcc is found (CUDA at /usr/local/cuda or on PATH), GPU or not.
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-build}"
case "$mode" in --run|--test|build) ;; *) echo "usage: scripts/setup.sh [--run|--test]" >&2; exit 2 ;; esac

packages=(cmake ninja-build g++ pkg-config libeigen3-dev libcli11-dev libyaml-cpp-dev googletest libgtest-dev
          libbenchmark-dev zlib1g-dev libopenmpi-dev openmpi-bin dataset-fashion-mnist)
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
if [ "$mode" = "--test" ]; then
  cmake --preset ci
  cmake --build build -j "$jobs"
  ctest --test-dir build --output-on-failure -j "$jobs" --timeout 600
elif [ "$mode" = "--run" ]; then
  cmake --preset default
  cmake --build build -j "$jobs" --target replica
  build/apps/replica train
else
  cmake --preset default
  cmake --build build -j "$jobs"
fi
