// libFuzzer target: the CIFAR-10 binary batch reader on arbitrary bytes (body in tests/fuzz/targets.h).
#include "targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  replica::fuzz::cifar(data, size);
  return 0;
}
