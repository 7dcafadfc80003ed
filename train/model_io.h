// The saved-model file: parameters and batch-norm statistics of a model, with the architecture
// name and a checksum, written atomically. `replica eval` and library users read it back.
#pragma once
#include <string>

#include "ops/nn/model.h"

namespace replica::train {

// Format (little-endian): "RPLM0001", u32 name length, name, i64 params, i64 buffers,
// f32 params[params], f32 buffers[buffers], u64 FNV-1a of everything before it.
void save_model(const nn::Model& model, const Tensor& params, const Tensor& buffers, const std::string& path);
// Loads into a materialized model of the same architecture; throws IoError naming the file and
// what does not match (magic, architecture, sizes, checksum).
void load_model(nn::Model& model, const std::string& path);

}  // namespace replica::train
