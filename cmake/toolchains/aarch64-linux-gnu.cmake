# Cross-compiling for 64-bit Arm Linux with Debian's g++-aarch64-linux-gnu: scripts/cross-aarch64.sh.
# Libraries come from Debian's arm64 packages (dpkg --add-architecture arm64), found under the
# multiarch directories; programs (protoc-like tools, git) are the build machine's own.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
# Header-only and architecture-independent packages (Eigen, CLI11) live in /usr/include and
# /usr/share; arm64 libraries in /usr/lib/aarch64-linux-gnu, which the multiarch lookup finds.
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
# Run the cross-built tests under qemu-user (ctest and gtest_discover_tests use this), with the
# multiarch arm64 C library (libc6:arm64, under /) rather than the cross compiler's sysroot: under
# qemu-user 7.2 the cross package's libc6-arm64-cross (2.36-8cross1) never returns from the first
# pthread_create (a three-line std::thread program hangs with it and runs with libc6:arm64).
find_program(REPLICA_QEMU_AARCH64 qemu-aarch64)
if(REPLICA_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${REPLICA_QEMU_AARCH64} -L /)
endif()
