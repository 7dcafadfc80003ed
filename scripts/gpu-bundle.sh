#!/usr/bin/env bash
# Builds the gpu-labelled tests and the replica binary with CUDA for one architecture and packs
# them, with the shared libraries they need that a bare GPU machine lacks (yaml-cpp, OpenMPI, ...),
# into one folder. CUDA's own libraries (cudart, NCCL, cuBLAS, cuDNN) are not packed: the GPU
# machine has them (system CUDA or Python's nvidia-* wheels; scripts/gpu-check.sh finds them).
#   scripts/gpu-bundle.sh [ARCH=90] [OUT_DIR=gpu-bundle]
set -euo pipefail
cd "$(dirname "$0")/.."
arch="${1:-90}"
out="${2:-gpu-bundle}"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DREPLICA_CUDA=ON -DREPLICA_NATIVE=OFF \
      -DCMAKE_CUDA_ARCHITECTURES="$arch" > /dev/null
cmake --build build-gpu -j "$(nproc)" --target replica test_core_gpu test_nccl test_cuda_conformance test_input_stager
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
cp build-gpu/apps/replica build-gpu/tests/test_core_gpu build-gpu/tests/test_nccl build-gpu/tests/test_cuda_conformance build-gpu/tests/test_input_stager "$out/bin/"
cp scripts/gpu-check.sh "$out/"
mkdir -p "$out/configs" "$out/bench/anchors"
cp configs/*.yaml "$out/configs/"
cp bench/anchors/torch_resnet50_amp.py "$out/bench/anchors/"
for b in "$out"/bin/*; do
  ldd "$b" | awk '/=> \// {print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*) ;;
    libcuda.so*|libcudart.so*|libnccl.so*|libcublas*|libcudnn*|libnvidia*) ;;
    *) cp -L "$lib" "$out/lib/" ;;
  esac
done
du -sh "$out"
echo "bundle ready: copy $out to the GPU machine and run $out/gpu-check.sh"
