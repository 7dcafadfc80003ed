#!/bin/sh
# The augmentation policies side by side, one core each: replica bench augment against
# torchvision's transforms (bench/anchors/torch_augment.py) on the same 224x224 RGB training
# crops (Fashion-MNIST written as 256-pixel JPEGs by `replica pack --idx`, as compare_data.sh
# does), run twice alternating. PyTorch and torchvision come from Debian.
# Usage: bench/compare_augment.sh [BUILD_DIR] [WORK_DIR]
set -eu
build=${1:-build}
work=${2:-/tmp/replica-bench-data}
replica="$build/apps/replica"
py=${PYTHON:-/usr/bin/python3}
[ -d "$work/train" ] || "$replica" pack --idx /usr/share/datasets/fashion-mnist "$work" --size 256 --quality 90 --limit 4096
common="--set data.dataset=folder --set data.path=$work --set data.image_size=224 --set data.hflip=true"
for run in 1 2; do
  echo "== run $run"
  "$replica" bench augment $common --images 256 --dump "$work/augment_images.npy"
  "$py" "$(dirname "$0")/anchors/torch_augment.py" "$work/augment_images.npy"
done
