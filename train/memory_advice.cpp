// The out-of-memory advice of a training run.
#include "train/memory_advice.h"

#include <sstream>

namespace replica::train {

std::string memory_advice(const OomReport& r) {
  std::ostringstream os;
  os << "To fit: use a smaller train.micro_batch with more accumulation steps, train.precision: "
        "fp16 or bf16, model.checkpoint: blocks, or ";
  if (r.options.bytes)
    os << "a larger memory.bytes (now " << format_bytes(r.options.bytes) << ").";
  else
    os << "a larger memory.fraction (now " << r.options.fraction << ", from " << r.options.fraction_source << ").";
  return os.str();
}

}  // namespace replica::train
