// Model file writing (atomic) and checked reading.
#include "train/model_io.h"

#include <cstring>
#include <fstream>
#include <sstream>

#include "core/alloc_trace.h"
#include "core/checksum.h"
#include "core/errors.h"

namespace replica::train {

namespace {
template <typename T>
void put(std::string& s, const T& v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
}  // namespace

void save_model(const nn::Model& model, const Tensor& params, const Tensor& buffers, const std::string& path) {
  std::string s = "RPLM0001";
  put<uint32_t>(s, static_cast<uint32_t>(model.name().size()));
  s += model.name();
  put<int64_t>(s, model.num_params());
  put<int64_t>(s, model.num_buffers());
  s += tensor_to_bytes(params.view(0, {model.num_params()}));
  s += tensor_to_bytes(buffers.view(0, {model.num_buffers()}));
  put<uint64_t>(s, fnv1a(s.data(), s.size()));
  write_file_atomic(path, s);
}

void load_model(nn::Model& model, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(path + ": cannot open the model file");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  if (s.size() < 8 + 4 + 16 + 8 || s.compare(0, 8, "RPLM0001") != 0)
    throw IoError(path + ": not a replica model file (bad magic or too short)");
  uint64_t want;
  std::memcpy(&want, s.data() + s.size() - 8, 8);
  if (fnv1a(s.data(), s.size() - 8) != want)  // no copy of the file
    throw IoError(path + ": checksum mismatch: the file is corrupt or truncated");
  size_t off = 8;
  uint32_t nlen;
  std::memcpy(&nlen, s.data() + off, 4);
  off += 4;
  std::string name = s.substr(off, nlen);
  off += nlen;
  if (name != model.name())
    throw IoError(path + ": holds a " + name + " but the configuration builds a " + model.name());
  int64_t np, nb;
  std::memcpy(&np, s.data() + off, 8);
  std::memcpy(&nb, s.data() + off + 8, 8);
  off += 16;
  if (np != model.num_params() || nb != model.num_buffers())
    throw IoError(path + ": parameter count " + std::to_string(np) + " does not match the model's " +
                  std::to_string(model.num_params()) + " (another width or number of classes?)");
  tensor_from_bytes(model.params().view(0, {np}), s.data() + off, static_cast<size_t>(np) * 4);
  off += static_cast<size_t>(np) * 4;
  tensor_from_bytes(model.buffers().view(0, {nb}), s.data() + off, static_cast<size_t>(nb) * 4);
  model.refresh_compute_copy();
}

}  // namespace replica::train
