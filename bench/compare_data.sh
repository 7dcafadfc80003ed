#!/bin/sh
# The input pipeline side by side: replica's folder and packed forms against torchvision's
# ImageFolder + DataLoader, decode + RandomResizedCrop(224) + flip from 256-pixel JPEGs, 1 and 2
# workers, run twice alternating. The images are Fashion-MNIST's written as 256x256 RGB JPEGs
# (`replica pack --idx`); PyTorch and torchvision come from Debian (python3-torchvision).
# Usage: bench/compare_data.sh [BUILD_DIR] [WORK_DIR]
set -eu
build=${1:-build}
work=${2:-/tmp/replica-bench-data}
replica="$build/apps/replica"
py=${PYTHON:-/usr/bin/python3}
if [ ! -d "$work/train" ]; then
  "$replica" pack --idx /usr/share/datasets/fashion-mnist "$work" --size 256 --quality 90 --limit 4096
fi
[ -f "$work/train.pack" ] || "$replica" pack "$work/train" "$work/train.pack" --max-side 256 --quality 90
[ -f "$work/val.pack" ] || "$replica" pack "$work/val" "$work/val.pack" --max-side 256 --quality 90
common="--set data.image_size=224 --set data.hflip=true --set data.mean=[0.485,0.456,0.406] --set data.std=[0.229,0.224,0.225]"
for run in 1 2; do
  echo "== run $run"
  "$replica" bench data --set data.dataset=folder --set data.path="$work" $common --workers 1 2 --images 2048
  "$py" "$(dirname "$0")/anchors/torch_data.py" "$work/train" --size 224 --images 2048 --workers 1 2
  "$replica" bench data --set data.dataset=packed --set data.path="$work" $common --workers 1 2 --images 2048
done
