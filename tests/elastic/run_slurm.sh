#!/usr/bin/env bash
# The Slurm recipe for real (label slurm): a one-node Slurm (munge, slurmctld and slurmd on this
# machine, started here with a configuration of their own) runs examples/slurm/replica.sbatch
# with 3 tasks (CPU replicas, srun --mpi=pmix); once checkpoints exist, the task of rank 1 is
# SIGKILLed. srun --kill-on-bad-exit ends the step, the script requeues the job, the job starts
# again with --resume and finishes. Exits 77 (ctest: skipped) with the reason where the daemons
# cannot run (not root, not installed, they do not come up).
#   tests/elastic/run_slurm.sh BUILD_DIR SOURCE_DIR
set -uo pipefail
build="$1"
src="$2"
skip() { echo "SKIP: $*"; exit 77; }
for c in slurmctld slurmd sbatch scontrol munged; do command -v "$c" > /dev/null || skip "$c not installed (slurm-wlm, munge)"; done
[ "$(id -u)" -eq 0 ] || skip "the test daemons run as root here"
work="$(mktemp -d)"
export SLURM_CONF="$work/slurm.conf"
started_munge=0
cleanup() {
  for p in slurmd slurmctld; do [ -f "$work/$p.pid" ] && kill "$(cat "$work/$p.pid")" 2> /dev/null; done
  [ "$started_munge" = 1 ] && pkill -x munged
  sleep 1
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/spool" "$work/state" /etc/munge /run/munge /var/lib/munge /var/log/munge
if ! pgrep -x munged > /dev/null; then
  [ -f /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2> /dev/null; chmod 400 /etc/munge/munge.key; }
  munged --force || skip "munged did not start"
  started_munge=1
fi
host="$(hostname)"
cat > "$SLURM_CONF" <<CONF
ClusterName=replicatest
SlurmctldHost=$host
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
AuthType=auth/munge
# how long a requeued job waits before it may start again (default 120 s)
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdSpoolDir=$work/spool
StateSaveLocation=$work/state
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
ReturnToService=2
JobRequeue=1
MpiDefault=none
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
slurmctld -f "$SLURM_CONF" || skip "slurmctld did not start: $(tail -3 "$work/slurmctld.log" 2> /dev/null)"
slurmd -f "$SLURM_CONF" || skip "slurmd did not start: $(tail -3 "$work/slurmd.log" 2> /dev/null)"
for _ in $(seq 50); do sinfo -h -o %T 2> /dev/null | grep -q idle && break; sleep 0.2; done
sinfo -h -o %T | grep -q idle || skip "the node did not come up: $(tail -3 "$work/slurmd.log")"
echo "== one-node Slurm up on $host"

run="$work/run"
job=$(RUN_DIR="$run" DEVICES=cpu:1 REPLICA="$build/apps/replica" MAX_RESTARTS=3 \
  sbatch --parsable --ntasks=3 --overcommit --output="$work/job.out" "$src/examples/slurm/replica.sbatch" "$src/configs/default.yaml" \
  --set model.width=8 --set data.limit_train=9600 --set data.limit_test=2000 --set train.global_batch=48 \
  --set train.epochs=1 --set checkpoint.every_steps=20 --set parallel.timeout_s=5 --set train.tensorboard=false \
  --set train.log_every=25)
echo "submitted job $job"
# The killer: the second checkpoint, then SIGKILL the task of rank 1 (a node gone).
for _ in $(seq 1200); do
  [ "$(ls "$run/checkpoints" 2> /dev/null | wc -l)" -ge 2 ] && break
  sleep 0.1
done
killed=0
for p in $(pgrep -f "apps/replica train"); do
  if tr '\0' '\n' < "/proc/$p/environ" 2> /dev/null | grep -q '^SLURM_PROCID=1$'; then kill -9 "$p"; killed=1; fi
done
[ "$killed" = 1 ] || { echo "FAIL: no task of rank 1 to kill"; scontrol show job "$job" | head -5; cat "$work/job.out"; exit 1; }
echo "killed rank 1 after $(ls "$run/checkpoints" | wc -l) checkpoint(s)"
state=""
for _ in $(seq 600); do
  state=$(scontrol show job "$job" 2> /dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2)
  [ "$state" = COMPLETED ] || [ "$state" = FAILED ] || [ "$state" = CANCELLED ] && break
  sleep 0.5
done
info=$(scontrol show job "$job")
echo "$info" | grep -oE 'JobState=[A-Z_]+|Restarts=[0-9]+|ExitCode=[0-9:]+' | tr '\n' ' '; echo
[ "$state" = COMPLETED ] || { echo "FAIL: job ended $state"; cat "$work/job.out"; exit 1; }
restarts=$(echo "$info" | grep -o 'Restarts=[0-9]*' | cut -d= -f2)
[ "${restarts:-0}" -ge 1 ] || { echo "FAIL: the job was not requeued"; cat "$work/job.out"; exit 1; }
grep -q "requeueing to resume" "$work/job.out" || { echo "FAIL: the script did not requeue"; cat "$work/job.out"; exit 1; }
grep -q "start 1 on .* --resume $run" "$work/job.out" || { echo "FAIL: the requeued start did not resume"; cat "$work/job.out"; exit 1; }
grep -q "resumed from" "$work/job.out" || { echo "FAIL: no resume line"; cat "$work/job.out"; exit 1; }
grep -q '"kind":"summary"' "$run/metrics.jsonl" || { echo "FAIL: the run did not finish"; exit 1; }
echo "Slurm: killed, requeued (Restarts=$restarts), resumed and finished; last eval:"
grep '"kind":"eval"' "$run/metrics.jsonl" | tail -1
