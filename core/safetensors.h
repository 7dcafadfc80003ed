// The safetensors file format (Hugging Face; read by PyTorch, JAX, TensorFlow): an 8-byte
// little-endian header length, a JSON header of name -> {dtype, shape, data_offsets} plus an
// optional "__metadata__" map of strings, then the raw little-endian tensor bytes. Reading checks
// everything a damaged or hostile file could get wrong; writing produces the same bytes as the
// reference implementation (tensors sorted by dtype, largest first, then by name; compact JSON;
// the header padded with spaces to 8 bytes), so a file read and written back is unchanged.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace replica::safetensors {

// Bytes per element of a dtype name ("F32", "BF16", "I64", ...); 0 for a name the format lacks.
size_t dtype_bytes(const std::string& dtype);

struct TensorView {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string_view data;  // points into the parsed bytes
  int64_t numel() const;
};

struct File {
  std::vector<TensorView> tensors;  // in file order
  std::vector<std::pair<std::string, std::string>> metadata;
  const TensorView* find(const std::string& name) const;
};

// Throws IoError naming `source` and what is wrong (header length, JSON, a dtype, a shape that
// does not match its bytes, offsets out of order, overlapping or leaving bytes unaccounted for).
File parse(std::string_view bytes, const std::string& source);

struct TensorData {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string data;
};
std::string serialize(std::vector<TensorData> tensors, const std::vector<std::pair<std::string, std::string>>& metadata);

}  // namespace replica::safetensors
