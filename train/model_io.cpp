// Model file writing (atomic) and checked reading.
#include "train/model_io.h"

#include <cstring>

#include "core/byte_reader.h"
#include "core/checksum.h"
#include "core/errors.h"
#include "core/file_io.h"

namespace replica::train {

namespace {
template <typename T>
void put(std::string& s, const T& v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
}  // namespace

namespace {
constexpr char kMagicV1[] = "RPLM0001";  // legacy FNV basis (core/checksum.h)
constexpr char kMagicV2[] = "RPLM0002";
}  // namespace

void save_model(const nn::Model& model, const Tensor& params, const Tensor& buffers, const std::string& path) {
  std::string s = kMagicV2;
  put<uint32_t>(s, static_cast<uint32_t>(model.name().size()));
  s += model.name();
  put<int64_t>(s, model.num_params());
  put<int64_t>(s, model.num_buffers());
  s += tensor_to_bytes(params.view(0, {model.num_params()}));
  s += tensor_to_bytes(buffers.view(0, {model.num_buffers()}));
  put<uint64_t>(s, fnv1a(s.data(), s.size()));
  write_file_atomic(path, s);
}

ModelFile parse_model_file(std::string_view bytes, const std::string& source) {
  ByteReader in(bytes, source);
  if (bytes.size() < 8 + 4 + 16 + 8 || (bytes.substr(0, 8) != kMagicV1 && bytes.substr(0, 8) != kMagicV2))
    throw IoError(source + ": not a replica model file (bad magic or too short)");
  const uint64_t basis = bytes.substr(0, 8) == kMagicV1 ? kFnv1aLegacyBasis : kFnv1aBasis;
  uint64_t want;
  std::memcpy(&want, bytes.data() + bytes.size() - 8, 8);
  if (fnv1a(bytes.data(), bytes.size() - 8, basis) != want)
    throw IoError(source + ": checksum mismatch: the file is corrupt or truncated");
  // The checksum proves the bytes are the writer's, not that the header is consistent: every
  // count is still checked against the bytes that are there.
  ByteReader body(bytes.substr(0, bytes.size() - 8), source);
  body.take(8, "the magic");
  ModelFile m;
  const uint32_t nlen = body.get<uint32_t>("the architecture name's length");
  if (nlen > 256) throw IoError(source + ": architecture name of " + std::to_string(nlen) + " bytes (damaged header)");
  m.arch = std::string(body.take(nlen, "the architecture name"));
  m.num_params = body.get<int64_t>("the parameter count");
  m.num_buffers = body.get<int64_t>("the buffer count");
  if (m.num_params < 0 || m.num_buffers < 0)
    throw IoError(source + ": negative parameter or buffer count (damaged header)");
  m.params = body.take_array(static_cast<uint64_t>(m.num_params), 4, "the parameters");
  m.buffers = body.take_array(static_cast<uint64_t>(m.num_buffers), 4, "the batch-norm buffers");
  if (body.remaining())
    throw IoError(source + ": " + std::to_string(body.remaining()) + " bytes more than the header promises");
  return m;
}

void load_model(nn::Model& model, const std::string& path) {
  const std::string s = read_file(path, "model file");
  const ModelFile m = parse_model_file(s, path);
  if (m.arch != model.name())
    throw IoError(path + ": holds a " + m.arch + " but the configuration builds a " + model.name());
  if (m.num_params != model.num_params() || m.num_buffers != model.num_buffers())
    throw IoError(path + ": parameter count " + std::to_string(m.num_params) + " does not match the model's " +
                  std::to_string(model.num_params()) + " (another width or number of classes?)");
  tensor_from_bytes(model.params().view(0, {m.num_params}), m.params.data(), m.params.size());
  tensor_from_bytes(model.buffers().view(0, {m.num_buffers}), m.buffers.data(), m.buffers.size());
  model.refresh_compute_copy();
}

}  // namespace replica::train
