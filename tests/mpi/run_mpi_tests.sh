#!/usr/bin/env bash
# The mpi-labelled tests: collectives over 2 processes x 2 replicas, in place over the pools'
# shared memory, through the node's shared window (REPLICA_MPI_ZERO_COPY=0: private pools) and
# (REPLICA_MPI_SHM=0) through MPI's own collectives; 2 processes x 1 replica train
# to the same bits as 1 process x 2 replicas; a rank that throws takes the job down within 30 s
# with a message naming it; a rank that stops taking part is named by the one that times out.
# OpenMPI as root needs --allow-run-as-root; --oversubscribe lets 2 processes share a 2-core machine with their helper threads; single-copy (CMA) is off because
# containers often forbid the ptrace it needs.
#   tests/mpi/run_mpi_tests.sh BUILD_DIR
set -euo pipefail
build="$1"
mpirun=(mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl_vader_single_copy_mechanism none -np 2)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "== collectives over MPI (between processes: in place, the shared window, then MPI's own collectives)"
"${mpirun[@]}" "$build/tests/test_mpi_collectives"
"${mpirun[@]}" -x REPLICA_MPI_ZERO_COPY=0 "$build/tests/test_mpi_collectives"
"${mpirun[@]}" -x REPLICA_MPI_SHM=0 "$build/tests/test_mpi_collectives"

echo "== 2 processes x 1 replica == 1 process x 2 replicas"
common=(--set model.width=8 --set data.dataset=synthetic --set "data.synthetic_shape=[12,12,1]"
        --set data.synthetic_size=1024 --set "data.mean=[0.5]" --set "data.std=[0.25]"
        --set train.global_batch=32 --set train.max_steps=8 --set train.eval=false --set train.tensorboard=false)
"$build/apps/replica" train --devices cpu:2 --run-dir "$work/one" "${common[@]}" > "$work/one.log"
"${mpirun[@]}" "$build/apps/replica" train --devices cpu:1 --run-dir "$work/two" "${common[@]}" > "$work/two.log"
if ! cmp "$work/one/model.bin" "$work/two/model.bin"; then
  echo "FAIL: the MPI run's parameters differ from the in-process run's"; exit 1
fi
grep -q "2 replicas" "$work/two.log" || { echo "FAIL: the MPI run did not see 2 replicas"; cat "$work/two.log"; exit 1; }
echo "identical model.bin (bit for bit)"

echo "== sharded (ZeRO-1 / ZeRO-2) over MPI == unsharded: 2 processes x 1 and x 2 replicas, fp32 and bf16"
# bf16: the fp32 masters are sharded too and the 16-bit copy is what is all-gathered.
for prec in fp32 bf16; do
  for local in 1 2; do
    shard_common=("${common[@]}" --set optim.name=adamw --set optim.lr=0.01 --set optim.clip_grad_norm=0.5
                  --set parallel.bucket_mb=0.05 --set train.precision=$prec)
    "${mpirun[@]}" "$build/apps/replica" train --devices cpu:$local --run-dir "$work/none$prec$local" \
      "${shard_common[@]}" > /dev/null
    for mode in optimizer gradients; do
      "${mpirun[@]}" "$build/apps/replica" train --devices cpu:$local --run-dir "$work/$mode$prec$local" \
        "${shard_common[@]}" --set parallel.shard=$mode > "$work/$mode$prec$local.log"
      grep -q "parallel.shard $mode" "$work/$mode$prec$local.log" ||
        { echo "FAIL: no sharding line"; cat "$work/$mode$prec$local.log"; exit 1; }
      if ! cmp "$work/none$prec$local/model.bin" "$work/$mode$prec$local/model.bin"; then
        echo "FAIL: parallel.shard=$mode in $prec over 2 x $local differs from the unsharded MPI run"; exit 1
      fi
    done
  done
done
echo "identical model.bin for both modes at 2 x 1 and 2 x 2, fp32 and bf16"

# Runs the collectives test with one planted fault; it must fail (not hang, not exit 0) within
# 30 s. Sets rc and elapsed; the log is $work/$1.log.
faulty_run() {
  local name="$1"; shift
  local start=$(date +%s)
  set +e
  timeout 60 "${mpirun[@]}" "$build/tests/test_mpi_collectives" "$@" > "$work/$name.log" 2>&1
  rc=$?
  set -e
  elapsed=$(( $(date +%s) - start ))
  if [ "$rc" -eq 0 ]; then echo "FAIL: the job exited 0"; cat "$work/$name.log"; exit 1; fi
  if [ "$rc" -eq 124 ]; then echo "FAIL: the job hung"; cat "$work/$name.log"; exit 1; fi
  [ "$elapsed" -le 30 ] || { echo "FAIL: took ${elapsed} s"; exit 1; }
}

echo "== a failing rank"
faulty_run fail --fail-rank 1
grep -q "global rank 1" "$work/fail.log" || { echo "FAIL: no message naming rank 1"; cat "$work/fail.log"; exit 1; }
grep -q "planted failure" "$work/fail.log" || { echo "FAIL: the cause is not reported"; cat "$work/fail.log"; exit 1; }
echo "job died in ${elapsed} s with exit code $rc, naming global rank 1"

echo "== a stopped rank is named"
faulty_run stall --stall-rank 1
[ "$rc" -eq 75 ] || { echo "FAIL: a time-out exits $rc, not 75 (restartable)"; cat "$work/stall.log"; exit 1; }
grep -q "process 1 (global rank 1) never reached it" "$work/stall.log" ||
  { echo "FAIL: the stopped rank is not named"; cat "$work/stall.log"; exit 1; }
echo "job died in ${elapsed} s naming the stopped process:"
grep "never reached" "$work/stall.log" | head -1
