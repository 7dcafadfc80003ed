// libFuzzer target: the IDX readers (images and labels, raw or gzip) on arbitrary bytes (body in tests/fuzz/targets.h).
#include "targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  replica::fuzz::idx(data, size);
  return 0;
}
