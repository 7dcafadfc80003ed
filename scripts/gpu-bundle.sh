#!/usr/bin/env bash
# Builds the gpu-labelled tests and the replica binary with CUDA for one architecture and packs
# them, with what a bare GPU machine lacks, into one folder that scripts/gpu-check.sh runs from:
# the shared libraries (yaml-cpp, OpenMPI, ...), Fashion-MNIST (Debian's dataset-fashion-mnist,
# 30 MB: the default run), the anchor scripts (PyTorch AMP ResNet-50, JAX ResNet-20), and one
# test binary per CUDA mutant of tests/mutate/mutations.txt ("device: cuda"; built with the
# mutation applied, which the check expects to fail). CUDA's own libraries (cudart, NCCL, cuBLAS,
# cuDNN) are not packed: the GPU machine has them (system CUDA or Python's nvidia-* wheels;
# scripts/gpu-check.sh finds them); NCCL 2.30 for the check's peers phase comes from ../shared/nccl.
#   scripts/gpu-bundle.sh [ARCH=90] [OUT_DIR=gpu-bundle]      (REPLICA_BUNDLE_MUTANTS=0: none)
# It also writes OUT_DIR.tar.xz, the same folder compressed.
set -euo pipefail
cd "$(dirname "$0")/.."
arch="${1:-90}"
out="${2:-gpu-bundle}"
targets=(replica test_core_gpu test_nccl test_cuda_conformance test_input_stager)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DREPLICA_CUDA=ON -DREPLICA_NATIVE=OFF \
      -DCMAKE_CUDA_ARCHITECTURES="$arch" > /dev/null
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/mutants"

# The CUDA mutants first (each rebuilds its test target with one line changed, then the original),
# so the binaries packed below are built from the unchanged tree.
if [ "${REPLICA_BUNDLE_MUTANTS:-1}" != 0 ]; then
  list=tests/mutate/mutations.txt
  restore=""
  trap '[ -n "$restore" ] && mv "$restore.orig" "$restore" && touch "$restore"' EXIT
  # One record per blank-line-separated block: id, file, find, replace, test lines.
  while IFS= read -r -d '' rec; do
    id=$(sed -n 's/^id: //p' <<<"$rec"); file=$(sed -n 's/^file: //p' <<<"$rec")
    find=$(sed -n 's/^find: //p' <<<"$rec"); replace=$(sed -n 's/^replace: //p' <<<"$rec")
    test=$(sed -n 's/^test: //p' <<<"$rec" | head -1); exe="${test%% *}" filter="${test#* }"
    if [ "$(grep -cF -- "$find" "$file")" != 1 ]; then echo "gpu-bundle: mutant $id is stale ($file)" >&2; exit 1; fi
    cp -p "$file" "$file.orig"; restore="$file"
    awk -v f="$find" -v r="$replace" '{ i = index($0, f); if (i && !done) { $0 = substr($0, 1, i - 1) r substr($0, i + length(f)); done = 1 } print }' \
      "$file.orig" > "$file"
    cmake --build build-gpu -j "$(nproc)" --target "$exe" > "/tmp/gpu-bundle-$id.log" 2>&1 ||
      { echo "gpu-bundle: mutant $id does not build (/tmp/gpu-bundle-$id.log)" >&2; exit 1; }
    cp "build-gpu/tests/$exe" "$out/mutants/$id"
    echo "$filter" > "$out/mutants/$id.filter"
    mv "$file.orig" "$file"; touch "$file"; restore=""
    echo "gpu-bundle: mutant $id built"
  done < <(awk -v RS= -v ORS='\0' '/(^|\n)device: cuda(\n|$)/' "$list")
fi

cmake --build build-gpu -j "$(nproc)" --target "${targets[@]}"
cp build-gpu/apps/replica build-gpu/tests/test_core_gpu build-gpu/tests/test_nccl build-gpu/tests/test_cuda_conformance build-gpu/tests/test_input_stager "$out/bin/"
cp scripts/gpu-check.sh "$out/"
mkdir -p "$out/configs" "$out/bench/anchors" "$out/data"
cp configs/*.yaml "$out/configs/"
cp bench/anchors/torch_resnet50_amp.py bench/anchors/jax_pmap_resnet.py "$out/bench/anchors/"
fmnist=/usr/share/datasets/fashion-mnist
if [ -d "$fmnist" ]; then
  cp -r "$fmnist" "$out/data/fashion-mnist"
else
  echo "gpu-bundle: $fmnist is missing (apt-get install dataset-fashion-mnist): the default run will not run there" >&2
fi
for b in "$out"/bin/*; do
  ldd "$b" | awk '/=> \// {print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*) ;;
    libcuda.so*|libcudart.so*|libnccl.so*|libcublas*|libcudnn*|libnvidia*) ;;
    *) cp -L "$lib" "$out/lib/" ;;
  esac
done
# NCCL 2.30.7 for the check's peers phase (ranks sharing the GPU; the machines carry 2.28.9): the
# small sm_90 build of ../shared/nccl (its README says how it was built), checked against its
# SHA256SUMS and unpacked into nccl/, which only that phase puts on the library path.
nccl_dir="${REPLICA_NCCL_DIR:-$(cd .. && pwd)/shared/nccl}"
if [ -f "$nccl_dir/libnccl.so.2.xz" ]; then
  (cd "$nccl_dir" && grep ' libnccl.so.2.xz$' SHA256SUMS | sha256sum -c --quiet) ||
    { echo "gpu-bundle: $nccl_dir/libnccl.so.2.xz fails its SHA256SUMS" >&2; exit 1; }
  mkdir -p "$out/nccl"
  xz -dc "$nccl_dir/libnccl.so.2.xz" > "$out/nccl/libnccl.so.2"
  want=$(awk '$2 == "libnccl.so.2" {print $1}' "$nccl_dir/SHA256SUMS")
  [ -z "$want" ] || [ "$(sha256sum < "$out/nccl/libnccl.so.2" | cut -d' ' -f1)" = "$want" ] ||
    { echo "gpu-bundle: the unpacked libnccl.so.2 does not match SHA256SUMS" >&2; exit 1; }
  echo "gpu-bundle: NCCL for the peers phase from $nccl_dir"
else
  echo "gpu-bundle: no $nccl_dir/libnccl.so.2.xz (REPLICA_NCCL_DIR): the check's peers phase will fail, naming it" >&2
fi
# One compressed file too: the binaries share their CUDA fat binaries, which xz stores once (the
# folder is ~60 MB, the archive about 35 MB, most of it the already-compressed Fashion-MNIST).
tar cJf "$out.tar.xz" -C "$(dirname "$out")" "$(basename "$out")"
du -sh "$out" "$out.tar.xz"
echo "bundle ready: copy $out (or $out.tar.xz, then tar xJf) to the GPU machine and run $out/gpu-check.sh"
