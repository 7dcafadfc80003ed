# Run at every build (cmake -P): writes the commit the sources are at, with "-dirty" when tracked
# files differ from it, into OUT as a #define, touching OUT only when that changed, so a commit
# recompiles build_info.cpp alone and `replica --version` never names a stale commit.
#   cmake -DSRC=<source dir> -DOUT=<header> -P git_commit.cmake
execute_process(COMMAND git rev-parse --short=12 HEAD WORKING_DIRECTORY ${SRC}
                OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR commit STREQUAL "")
  set(commit unknown)
else()
  execute_process(COMMAND git diff --quiet HEAD -- WORKING_DIRECTORY ${SRC} RESULT_VARIABLE dirty ERROR_QUIET)
  if(dirty EQUAL 1)
    string(APPEND commit "-dirty")
  endif()
endif()
file(WRITE ${OUT}.tmp "// Generated at build time by apps/git_commit.cmake.\n#define REPLICA_GIT_COMMIT \"${commit}\"\n")
execute_process(COMMAND ${CMAKE_COMMAND} -E copy_if_different ${OUT}.tmp ${OUT})
file(REMOVE ${OUT}.tmp)
