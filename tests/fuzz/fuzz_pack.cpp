// libFuzzer target: the packed image file's header and index reader (body in tests/fuzz/targets.h).
#include "targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  replica::fuzz::pack(data, size);
  return 0;
}
