#!/usr/bin/env bash
# Runs a replica training launch until the run finishes, resuming it after every restartable
# stop: the loop that Slurm batch scripts and Kubernetes MPIJobs wrap around `replica train`.
#   resume-loop.sh RUN_DIR LAUNCH...
# LAUNCH is the whole launch line (e.g. `srun replica train cfg.yaml --run-dir RUN_DIR` or
# `mpirun -np 4 replica train ...`); once RUN_DIR holds a checkpoint, `--resume RUN_DIR` is
# appended. Each attempt sees ATTEMPT (0, 1, ...) in its environment, so a launcher can pick the
# process count the machines that are left allow. Exit statuses (train/recovery.h):
#   0   finished (or stopped for a preemption notice: the next start resumes)  -> stop, 0
#   2   a configuration to fix; 1 an error a restart would repeat              -> stop, that status
#   75  a peer was lost or a collective timed out (restartable); any other status, e.g. a launcher
#       that killed its ranks after one died (mpirun: 137, 143)                -> restart
# MAX_RESTARTS (default 10) bounds the restarts; RESTART_DELAY_S (default 1) waits between them.
set -uo pipefail
run_dir="$1"
shift
max="${MAX_RESTARTS:-10}"
for attempt in $(seq 0 "$max"); do
  args=("$@")
  if compgen -G "$run_dir/checkpoints/step-*.ckpt" > /dev/null; then args+=(--resume "$run_dir"); fi
  echo "resume-loop: attempt $attempt: ${args[*]}" >&2
  ATTEMPT="$attempt" "${args[@]}"
  rc=$?
  case "$rc" in
    0) echo "resume-loop: finished after $attempt restart(s)" >&2; exit 0 ;;
    1|2) echo "resume-loop: exit $rc is not restartable; stopping" >&2; exit "$rc" ;;
    *) echo "resume-loop: exit $rc: restarting from the newest checkpoint in $run_dir" >&2
       sleep "${RESTART_DELAY_S:-1}" ;;
  esac
done
echo "resume-loop: gave up after $max restarts" >&2
exit 75
