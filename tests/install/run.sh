#!/bin/sh
# Installs the build in BUILD_DIR into a temporary prefix, builds the custom-trainer example there
# as an outside project with find_package(replica), runs it, and runs the installed command.
# Usage: tests/install/run.sh BUILD_DIR SOURCE_DIR CXX_COMPILER
set -eu
build=$(cd "$1" && pwd) src=$(cd "$2" && pwd) cxx=$3
work=$(mktemp -d "${TMPDIR:-/tmp}/replica-install.XXXXXX")
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
generator=""
command -v ninja >/dev/null && generator="-G Ninja"
cmake -S "$src/tests/install" -B "$work/build" $generator -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DREPLICA_EXAMPLE="$src/apps/examples/custom_trainer.cpp" >/dev/null
cmake --build "$work/build" >/dev/null
"$work/build/custom_trainer"
"$work/prefix/bin/replica" --version
echo "installed package: find_package(replica) + replica::train built and ran the custom trainer"
