#!/usr/bin/env bash
# `replica plan` against published data-parallel ResNet-50 scaling results (#31): each case's
# hardware as its source states it, the model's predicted scaling efficiency beside the published
# one. The step profile is bench/profiles/resnet50_224_cpu.json (ResNet-50 v1.5, 224x224, 1000
# classes, measured on a CPU here: only the shape of the step is used, the forward / backward
# split and the order and timing of the gradients) rescaled to the GPU's published single-device
# throughput with --device-images-per-s. Sources and inputs: bench/RESULTS.md, "Planning before
# renting (#31)".
#   bench/plan_published.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${1:-build}/apps/replica"
profile=bench/profiles/resnet50_224_cpu.json
# efficiency column of plan's table for the one alternative asked
eff() {  # GLOBAL_BATCH DEVICES IMAGES_PER_S LINK [INTER NICS]
  local extra=()
  [ $# -ge 5 ] && extra=(--inter-link "$5" --nics "$6")
  "$bin" plan configs/resnet50_synthetic_gpu.yaml --set train.global_batch="$1" --set train.micro_batch=0 \
    --device-profile "$profile" --device-images-per-s "$3" --devices "$2" --link "$4" "${extra[@]}" --no-memory |
    awk '$1 ~ /^[0-9x]+$/ {for (i = 1; i <= NF; i++) if ($i ~ /%$/) {sub("%", "", $i); print $i; exit}}'
}
row() {  # NAME PUBLISHED PREDICTED
  awk -v n="$1" -v pub="$2" -v pred="$3" 'BEGIN {printf "| %s | %.1f%% | %.1f%% | %.2f |\n", n, pub, pred, pred / pub}'
}
echo "| case | published efficiency | predicted | predicted / published |"
echo "|---|---|---|---|"
# 1. Goyal et al. 2017 (arXiv:1706.02677): Big Basin servers, 8 P100 on NVLink each, one 50 Gb/s
#    Ethernet port per server; 32 images per GPU; "backward on a single P100 takes 120 ms"; ~90%
#    scaling efficiency from 8 to 256 GPUs. P100 rate: 32 images per 120 ms backward + 60 ms
#    forward (half of backward, an assumption) = 178 img/s.
e8=$(eff 256 1x8 178 nvlink1)
e256=$(eff 8192 32x8 178 nvlink1 eth50 1)
row "Goyal et al. 2017: 8 -> 256 P100, 32 servers x 8, NVLink + 50 GbE" 90 "$(awk -v a="$e256" -v b="$e8" 'BEGIN {print 100 * a / b}')"
# 2. TensorFlow's benchmarks (tensorflow.org/performance/benchmarks, 2017), NVIDIA DGX-1 (8 P100
#    on NVLink), ResNet-50, batch 64 per GPU, synthetic data: 142 img/s on 1 GPU, 1131 on 8 (99.6%).
row "TensorFlow benchmarks 2017: DGX-1, 1 -> 8 P100 on NVLink" 99.6 "$(eff 512 8 142 nvlink1)"
# 3. The same benchmarks on Piz Daint (CSCS; one P100 per node, Cray Aries), published beside them
#    (e-bug/distributed-tensorflow-benchmarks): 138.23 img/s on 1 node, 1018.18 on 8 (92.1%).
#    Aries: ~10 GB/s per node injection, taken as ib-edr's 12.5 GB/s x 0.8.
row "Piz Daint 2017: 1 -> 8 nodes of 1 P100, Cray Aries" 92.1 "$(eff 512 8x1 138.23 nvlink1 ib-edr 1)"
# 4. Zhang et al. 2020 (arXiv:2006.10103): AWS p3dn.24xlarge (8 V100 on NVLink, 100 Gb/s
#    Ethernet), Horovod: scaling factors of 60-76% at 64 GPUs across the models measured. V100
#    ResNet-50 fp32 rate ~360 img/s at 32 per GPU (an assumption; the paper's exact batch not used).
e8=$(eff 256 1x8 360 nvlink2)
e64=$(eff 2048 8x8 360 nvlink2 eth100 1)
row "Zhang et al. 2020: 8 -> 64 V100, 8 x p3dn (NVLink + 100 GbE)" 76 "$(awk -v a="$e64" -v b="$e8" 'BEGIN {print 100 * a / b}')"
