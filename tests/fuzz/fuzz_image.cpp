// libFuzzer target: JPEG and PNG decoding (libjpeg-turbo, libpng) on arbitrary bytes (body in tests/fuzz/targets.h).
#include "targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  replica::fuzz::image(data, size);
  return 0;
}
