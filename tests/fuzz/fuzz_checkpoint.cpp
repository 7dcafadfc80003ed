// libFuzzer target: the checkpoint reader on arbitrary bytes (body in tests/fuzz/targets.h).
#include "targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  replica::fuzz::checkpoint(data, size);
  return 0;
}
