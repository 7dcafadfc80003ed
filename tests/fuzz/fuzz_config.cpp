// libFuzzer target: the YAML configuration and a --set value on arbitrary bytes (body in tests/fuzz/targets.h).
#include "targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  replica::fuzz::config(data, size);
  return 0;
}
