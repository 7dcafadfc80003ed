#!/usr/bin/env bash
# Elastic continuation across processes (label mpi): 3 MPI processes train ResNet-20 on a
# Fashion-MNIST subset under examples/elastic/resume-loop.sh; once checkpoints exist, process 1 is
# killed with SIGKILL (a spot instance gone). The job must end within parallel.timeout_s + 5 s of
# the kill with a restartable status, the loop must resume it on 2 processes from the newest
# checkpoint (the global batch kept), and the run must finish with a test accuracy within 3
# points of an undisturbed 3-process run.
#   tests/elastic/run_elastic_mpi.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build="$1"
src="$2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
timeout_s=5
mpirun=(mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl_vader_single_copy_mechanism none)
common=(--devices cpu:1 --set model.width=8 --set data.limit_train=12000 --set data.limit_test=2000
        --set train.global_batch=48 --set train.epochs=2 --set checkpoint.every_steps=20
        --set parallel.timeout_s=$timeout_s --set train.tensorboard=false --set train.log_every=25)
accuracy() { grep '"kind":"eval"' "$1/metrics.jsonl" | tail -1 | grep -o '"accuracy":[0-9.]*' | cut -d: -f2; }

echo "== undisturbed: 3 processes"
"${mpirun[@]}" -np 3 "$build/apps/replica" train --run-dir "$work/straight" "${common[@]}" > "$work/straight.log" 2>&1
base=$(accuracy "$work/straight")
echo "test accuracy $base"

echo "== 3 processes, process 1 killed once checkpoints exist; the loop resumes on 2"
cat > "$work/launch.sh" <<LAUNCH
#!/usr/bin/env bash
np=3; [ "\${ATTEMPT:-0}" -gt 0 ] && np=2
${mpirun[*]} -np \$np "$build/apps/replica" train --run-dir "$work/elastic" ${common[*]} "\$@"
rc=\$?
[ "\${ATTEMPT:-0}" -eq 0 ] && date +%s.%N > "$work/ended_at"
exit \$rc
LAUNCH
chmod +x "$work/launch.sh"
( # the killer: waits for the second checkpoint, then SIGKILLs the process of global rank 1
  for _ in $(seq 600); do
    [ "$(ls "$work/elastic/checkpoints" 2>/dev/null | wc -l)" -ge 2 ] && break
    sleep 0.1
  done
  for p in $(pgrep -f "apps/replica train --run-dir $work/elastic"); do
    if tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -q '^OMPI_COMM_WORLD_RANK=1$'; then
      date +%s.%N > "$work/killed_at"
      kill -9 "$p"
    fi
  done
) &
killer=$!
RESTART_DELAY_S=0 "$src/examples/elastic/resume-loop.sh" "$work/elastic" "$work/launch.sh" > "$work/elastic.log" 2>&1
rc=$?
wait "$killer" || true
[ -f "$work/killed_at" ] || { echo "FAIL: the killer found no rank 1 process"; tail -20 "$work/elastic.log"; exit 1; }
[ "$rc" -eq 0 ] || { echo "FAIL: the loop exited $rc"; tail -30 "$work/elastic.log"; exit 1; }
grep -q "resume-loop: attempt 1" "$work/elastic.log" || { echo "FAIL: no restart"; tail -30 "$work/elastic.log"; exit 1; }
first_rc=$(grep -o "resume-loop: exit [0-9]*: restarting" "$work/elastic.log" | head -1 | grep -o "[0-9]*")
echo "the first attempt ended with exit $first_rc (restartable)"
grep -q "the checkpoint ran on 3 replica(s), this run on 2" "$work/elastic.log" ||
  { echo "FAIL: the restart did not resume the 3-replica checkpoint on 2"; tail -30 "$work/elastic.log"; exit 1; }
took=$(echo "$(cat "$work/ended_at") - $(cat "$work/killed_at")" | bc)
echo "the job ended ${took} s after the kill (limit: parallel.timeout_s $timeout_s + 5 s)"
awk -v t="$took" -v l="$((timeout_s + 5))" 'BEGIN { exit !(t <= l) }' || { echo "FAIL: took ${took} s"; exit 1; }
acc=$(accuracy "$work/elastic")
echo "test accuracy $acc after the loss (undisturbed $base)"
awk -v a="$acc" -v b="$base" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 0.03) }' ||
  { echo "FAIL: accuracy $acc is not within 3 points of $base"; exit 1; }
echo "elastic MPI run: killed, restarted on 2 processes, finished within the accuracy band"
