#!/bin/sh
# Installs the build in BUILD_DIR into a temporary prefix, builds the custom-trainer example there
# as an outside project with find_package(replica), runs it, and runs the installed command.
# With "deb": makes the Debian package (cpack -G DEB), checks its control fields, unpacks it
# into a fresh root and does the same against that root's /usr.
# Usage: tests/install/run.sh BUILD_DIR SOURCE_DIR CXX_COMPILER [install|deb]
set -eu
build=$(cd "$1" && pwd) src=$(cd "$2" && pwd) cxx=$3 mode=${4:-install}
work=$(mktemp -d "${TMPDIR:-/tmp}/replica-install.XXXXXX")
trap 'rm -rf "$work"' EXIT
if [ "$mode" = deb ]; then
  for tool in cpack dpkg-deb dpkg-shlibdeps; do
    command -v "$tool" >/dev/null || { echo "$tool not found (dpkg-dev): cannot make the package"; exit 77; }
  done
  (cd "$work" && cpack -G DEB --config "$build/CPackConfig.cmake" -B "$work/pkg" >"$work/cpack.log" 2>&1) ||
    { cat "$work/cpack.log"; exit 1; }
  deb=$(ls "$work"/pkg/*.deb)
  echo "package: $(basename "$deb"), $(du -k "$deb" | cut -f1) KiB"
  dpkg-deb -f "$deb" Package Version Architecture Depends
  depends=$(dpkg-deb -f "$deb" Depends)
  # Run time (dpkg-shlibdeps on bin/replica) and build time (find_dependency in the CMake package).
  for need in libc6 libstdc++6 libyaml-cpp libturbojpeg libeigen3-dev libyaml-cpp-dev; do
    case "$depends" in *"$need"*) ;; *) echo "Depends lacks $need: $depends"; exit 1 ;; esac
  done
  dpkg-deb -x "$deb" "$work/root"
  for f in usr/bin/replica usr/lib/cmake/replica/replicaConfig.cmake usr/lib/libreplica_train.a usr/include/replica/train/trainer.h; do
    [ -e "$work/root/$f" ] || { echo "the package has no /$f:"; dpkg-deb -c "$deb" | head -40; exit 1; }
  done
  ln -s "$work/root/usr" "$work/prefix"
else
  cmake --install "$build" --prefix "$work/prefix" >/dev/null
fi
generator=""
command -v ninja >/dev/null && generator="-G Ninja"
cmake -S "$src/tests/install" -B "$work/build" $generator -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DREPLICA_EXAMPLE="$src/apps/examples/custom_trainer.cpp" >/dev/null
cmake --build "$work/build" >/dev/null
"$work/build/custom_trainer"
"$work/prefix/bin/replica" --version
echo "installed package: find_package(replica) + replica::train built and ran the custom trainer"
