// libFuzzer target: the model-file reader (model.bin) on arbitrary bytes (body in tests/fuzz/targets.h).
#include "targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  replica::fuzz::model_file(data, size);
  return 0;
}
