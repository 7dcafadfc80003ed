#!/usr/bin/env bash
# Runs every libFuzzer target for a fixed number of executions from its committed seed corpus
# (copied, so the committed one stays small) and prints executions, executions per second and
# the outcome, as a table for bench/RESULTS.md. Not part of CI (CI runs each target briefly).
#   tests/fuzz/run.sh [RUNS]        default 1000000 executions per target
# Needs the asan preset's build (clang, the fuzz targets included): cmake --preset asan && cmake --build build-asan
# A crash leaves its input as build-asan/fuzz-work/<target>/crash-*: commit it under
# tests/fuzz/regressions/<target>/ so the normal suite replays it (test_fuzz_regressions).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
runs="${1:-1000000}"
bin="$root/${REPLICA_FUZZ_BUILD:-build-asan}/tests/fuzz"
work="$root/${REPLICA_FUZZ_BUILD:-build-asan}/fuzz-work"
status=0
echo "| target | executions | exec/s | seconds | corpus | result |"
echo "|---|---|---|---|---|---|"
for target in fuzz_checkpoint fuzz_model_file fuzz_idx fuzz_cifar fuzz_config fuzz_safetensors fuzz_image fuzz_pack; do
  [ -x "$bin/$target" ] || { echo "fuzz: $bin/$target is not built (cmake --preset asan)" >&2; exit 2; }
  rm -rf "$work/$target"
  mkdir -p "$work/$target/corpus"
  cp "$root/tests/fuzz/corpus/$target/"* "$work/$target/corpus/"
  dict=()
  case "$target" in
    fuzz_checkpoint) dict=(-dict="$root/tests/fuzz/checkpoint.dict") ;;
    fuzz_config) dict=(-dict="$root/tests/fuzz/config.dict") ;;
  esac
  start=$(date +%s.%N)
  set +e
  (cd "$work/$target" && ASAN_OPTIONS=detect_leaks=1 "$bin/$target" "${dict[@]}" -runs="$runs" -max_len=65536 \
      -rss_limit_mb=2048 -print_final_stats=1 corpus > log 2>&1)
  rc=$?
  set -e
  secs=$(echo "$(date +%s.%N) - $start" | bc)
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$work/$target/log" | grep -o '[0-9]*$' || echo 0)
  rate=$(echo "$execs / $secs" | bc)
  size=$(ls "$work/$target/corpus" | wc -l)
  result="clean"
  if [ "$rc" -ne 0 ]; then result="FAILED (exit $rc, see $work/$target/log)"; status=1; fi
  printf '| %s | %s | %s | %.0f | %s files | %s |\n' "$target" "$execs" "$rate" "$secs" "$size" "$result"
done
exit $status
