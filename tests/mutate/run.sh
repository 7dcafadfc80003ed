#!/usr/bin/env bash
# Mutation check: applies each single-line mutation of tests/mutate/mutations.txt to a copy of the
# working tree, rebuilds only the test targets it names (cpu-only, incremental), runs the named
# tests, and prints which mutants survived. Not part of CI (about a minute a mutant on 2 cores);
# run it after changing a test or a claim and copy its table into tests/README.md.
#   tests/mutate/run.sh [ID ...]      all mutants, or only those named
# The copy lives in $REPLICA_MUTATE_DIR (default: build-mutate/ in the repository, ignored by git)
# and is refreshed from the working tree on every run; the working tree itself is never touched.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
list="$root/tests/mutate/mutations.txt"
work="${REPLICA_MUTATE_DIR:-$root/build-mutate}"
src="$work/src" bld="$work/build"
mkdir -p "$src"
# Refresh the copy: tracked and untracked-but-not-ignored files, as they are now. Only files whose
# contents differ are copied, with a new time stamp, so the incremental build sees every change
# (a copy keeping the source's older time stamp could hide one from ninja).
(cd "$root" && git ls-files -z --cached --others --exclude-standard) |
  while IFS= read -r -d '' f; do
    [ -f "$root/$f" ] || continue
    if ! cmp -s "$root/$f" "$src/$f"; then
      mkdir -p "$src/$(dirname "$f")"
      cp "$root/$f" "$src/$f"
    fi
  done
if [ ! -f "$bld/build.ninja" ]; then
  cmake -S "$src" -B "$bld" -G Ninja -DCMAKE_BUILD_TYPE=Release -DREPLICA_CUDA=OFF >/dev/null
fi
only=" $* "
results=()
killed=0 survived=0 stale=0
run_one() {  # id claim file find replace tests...
  local id="$1" claim="$2" file="$3" find="$4" replace="$5"; shift 5
  local target="$src/$file"
  local count
  count=$(grep -cF -- "$find" "$target" || true)
  if [ "$count" != 1 ]; then
    results+=("| $id | $claim | stale: the line occurs $count times in $file |")
    stale=$((stale + 1)); return
  fi
  cp -p "$target" "$target.orig"
  awk -v f="$find" -v r="$replace" '{ i = index($0, f); if (i && !done) { $0 = substr($0, 1, i - 1) r substr($0, i + length(f)); done = 1 } print }' \
    "$target.orig" > "$target"
  local verdict="survived" by=""
  local targets=()
  for t in "$@"; do targets+=("${t%% *}"); done
  if ! cmake --build "$bld" --target "${targets[@]}" >"$work/$id.build.log" 2>&1; then
    verdict="killed"; by="does not compile"
  else
    for t in "$@"; do
      local exe="${t%% *}" filter="${t#* }"
      if ! (cd "$bld" && timeout 600 "tests/$exe" --gtest_filter="$filter" >"$work/$id.$exe.log" 2>&1); then
        verdict="killed"; by="${by:+$by, }$exe $filter"
      fi
    done
  fi
  mv "$target.orig" "$target"
  touch "$target"  # the next build recompiles the original
  if [ "$verdict" = killed ]; then killed=$((killed + 1)); else survived=$((survived + 1)); fi
  results+=("| $id | $claim | $verdict${by:+ by $by} |")
  echo "mutate: $id: $verdict${by:+ by $by}" >&2
}
id="" claim="" file="" find="" replace="" device="" tests=()
flush() {
  if [ -n "$id" ] && { [ "$only" = "  " ] || [[ "$only" == *" $id "* ]]; }; then
    if [ "$device" = cuda ]; then  # CUDA code, killed only where a GPU runs it: scripts/gpu-bundle.sh
      # Its line must still be there once, or the bundle's build of it stops (and the claim is unguarded).
      local count
      count=$(grep -cF -- "$find" "$src/$file" || true)
      if [ "$count" != 1 ]; then
        results+=("| $id | $claim | stale: the line occurs $count times in $file |")
        stale=$((stale + 1))
      else
        results+=("| $id | $claim | on a GPU: scripts/gpu-bundle.sh builds it, scripts/gpu-check.sh runs it |")
      fi
    else
      run_one "$id" "$claim" "$file" "$find" "$replace" "${tests[@]}"
    fi
  fi
  id="" claim="" file="" find="" replace="" device="" tests=()
}
while IFS= read -r line || [ -n "$line" ]; do
  case "$line" in
    "#"*) ;;
    "") flush ;;
    id:*) id="${line#id: }" ;;
    claim:*) claim="${line#claim: }" ;;
    file:*) file="${line#file: }" ;;
    find:*) find="${line#find: }" ;;
    replace:*) replace="${line#replace: }" ;;
    device:*) device="${line#device: }" ;;
    test:*) tests+=("${line#test: }") ;;
    *) echo "mutate: $list: cannot read the line '$line'" >&2; exit 2 ;;
  esac
done < "$list"
flush
echo "| mutant | claim | result |"
echo "|---|---|---|"
printf '%s\n' "${results[@]}"
echo
echo "$killed killed, $survived survived, $stale stale ($(date -u +%Y-%m-%d))"
[ "$survived" -eq 0 ] && [ "$stale" -eq 0 ]
