// libFuzzer target: the safetensors reader (weights from PyTorch) on arbitrary bytes (body in tests/fuzz/targets.h).
#include "targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  replica::fuzz::safetensors_file(data, size);
  return 0;
}
