// The saved-model file: parameters and batch-norm statistics of a model, with the architecture
// name and a checksum, written atomically. `replica eval` and library users read it back.
#pragma once
#include <string>
#include <string_view>

#include "ops/nn/model.h"

namespace replica::train {

// Format (little-endian): "RPLM0002", u32 name length, name, i64 params, i64 buffers,
// f32 params[params], f32 buffers[buffers], u64 FNV-1a 64 (standard basis) of everything before
// it. "RPLM0001" files (the same with core/checksum.h's legacy basis) are still read.
void save_model(const nn::Model& model, const Tensor& params, const Tensor& buffers, const std::string& path);
// Loads into a materialized model of the same architecture; throws IoError naming the file and
// what does not match (magic, architecture, sizes, checksum).
void load_model(nn::Model& model, const std::string& path);

// The file's contents, checked (magic, checksum, every count against the bytes present) but not
// yet matched to a model; the views point into `bytes`.
struct ModelFile {
  std::string arch;
  int64_t num_params = 0, num_buffers = 0;
  std::string_view params, buffers;  // f32, little-endian
};
ModelFile parse_model_file(std::string_view bytes, const std::string& source);

}  // namespace replica::train
