// safetensors reading (the header through nlohmann-json, held to the reference reader's rules) and writing.
#include "core/safetensors.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "core/errors.h"
#include "core/json.h"

namespace replica::safetensors {

namespace {

// The dtypes in the reference implementation's order (its sort key), with their sizes.
struct DtypeInfo {
  const char* name;
  size_t bytes;
};
constexpr DtypeInfo kDtypes[] = {{"BOOL", 1}, {"U8", 1},   {"I8", 1},   {"F8_E5M2", 1}, {"F8_E4M3", 1},
                                 {"I16", 2},  {"U16", 2},  {"F16", 2},  {"BF16", 2},    {"I32", 4},
                                 {"U32", 4},  {"F32", 4},  {"F64", 8},  {"I64", 8},     {"U64", 8}};
int dtype_rank(const std::string& d) {
  for (size_t i = 0; i < sizeof(kDtypes) / sizeof(kDtypes[0]); ++i)
    if (d == kDtypes[i].name) return static_cast<int>(i);
  return -1;
}

constexpr uint64_t kMaxHeader = 100000000;  // the reference reader's limit

[[noreturn]] void header_error(const std::string& source, const std::string& what) {
  throw IoError(source + ": safetensors header: " + what);
}

// The header as nlohmann-json reads it, with the reference reader's strictness added: a key
// twice in one object is an error (the library would keep the last), containers nest at most as
// deep as a header's own (top object > tensor > shape), and the top-level names come back in file
// order (a plain json's std::map sorts them; ordered_json's insertion is quadratic in the key
// count, which a crafted 100 MB header would turn into a hang).
struct Header {
  nlohmann::json doc;
  std::vector<std::string> order;
};
Header read_header(std::string_view text, const std::string& source) {
  Header h;
  std::vector<std::set<std::string>> keys;  // one per open object
  auto check = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if ((event == E::object_start || event == E::array_start) && depth > 2)
      header_error(source, "nested deeper than a header's tensor entries");
    if (event == E::object_start) keys.emplace_back();
    if (event == E::object_end) keys.pop_back();
    if (event == E::key) {
      const auto& k = parsed.get_ref<const std::string&>();
      if (!keys.back().insert(k).second) header_error(source, "'" + k + "' appears twice");
      if (depth == 1) h.order.push_back(k);
    }
    return true;
  };
  try {
    h.doc = nlohmann::json::parse(text, check);
  } catch (const nlohmann::json::parse_error& e) {
    throw IoError(source + ": safetensors header, byte " + std::to_string(e.byte) + ": " + e.what());
  } catch (const nlohmann::json::exception& e) {  // e.g. a number too large for a double
    throw IoError(source + ": safetensors header: " + e.what());
  }
  if (!h.doc.is_object()) header_error(source, std::string("a JSON ") + h.doc.type_name() + ", not an object");
  return h;
}

std::vector<uint64_t> integers(const nlohmann::json& v, const std::string& what, const std::string& source) {
  if (!v.is_array()) header_error(source, what + " is not an array");
  std::vector<uint64_t> out;
  for (const auto& x : v) {
    if (!x.is_number_unsigned()) header_error(source, what + " holds " + x.dump() + ", not a non-negative integer");
    out.push_back(x.get<uint64_t>());
  }
  return out;
}

}  // namespace

size_t dtype_bytes(const std::string& dtype) {
  const int r = dtype_rank(dtype);
  return r < 0 ? 0 : kDtypes[r].bytes;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const TensorView* File::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

File parse(std::string_view bytes, const std::string& source) {
  if (bytes.size() < 8) throw IoError(source + ": not a safetensors file (" + std::to_string(bytes.size()) + " bytes)");
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = n << 8 | static_cast<unsigned char>(bytes[k]);
  if (n > kMaxHeader || n > bytes.size() - 8)
    throw IoError(source + ": safetensors header of " + std::to_string(n) + " bytes in a file of " +
                  std::to_string(bytes.size()) + " (truncated, or not a safetensors file)");
  const Header h = read_header(bytes.substr(8, n), source);
  const std::string_view data = bytes.substr(8 + n);
  File f;
  struct Span {
    uint64_t lo, hi;
    size_t index;
  };
  std::vector<Span> spans;
  for (const std::string& name : h.order) {
    const nlohmann::json& entry = h.doc.at(name);
    if (!entry.is_object()) header_error(source, "'" + name + "' is not an object");
    if (name == "__metadata__") {
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) header_error(source, "__metadata__ '" + k + "' is not a string");
        f.metadata.emplace_back(k, v.get<std::string>());
      }
      continue;
    }
    for (const auto& [k, v] : entry.items())
      if (k != "dtype" && k != "shape" && k != "data_offsets") header_error(source, "'" + name + "': unknown field '" + k + "'");
    if (!entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets"))
      header_error(source, "'" + name + "' needs dtype, shape and data_offsets");
    TensorView t;
    t.name = name;
    if (!entry["dtype"].is_string()) header_error(source, "'" + name + "': dtype is not a string");
    t.dtype = entry["dtype"].get<std::string>();
    for (uint64_t d : integers(entry["shape"], "'" + name + "': shape", source)) {
      if (d > (uint64_t(1) << 48)) header_error(source, "'" + name + "': dimension " + std::to_string(d) + " is too large");
      t.shape.push_back(static_cast<int64_t>(d));
    }
    const std::vector<uint64_t> off = integers(entry["data_offsets"], "'" + name + "': data_offsets", source);
    const size_t es = dtype_bytes(t.dtype);
    if (!es) header_error(source, "'" + name + "': unknown dtype '" + t.dtype + "'");
    if (off.size() != 2 || off[0] > off[1] || off[1] > data.size())
      throw IoError(source + ": tensor '" + name + "': data_offsets outside the " + std::to_string(data.size()) +
                    " data bytes (truncated file?)");
    unsigned __int128 want = es;
    for (int64_t d : t.shape) want *= static_cast<uint64_t>(d);
    if (want != off[1] - off[0])
      throw IoError(source + ": tensor '" + name + "': shape and dtype need " + std::to_string(static_cast<uint64_t>(want)) +
                    " bytes, its offsets give " + std::to_string(off[1] - off[0]));
    t.data = data.substr(off[0], off[1] - off[0]);
    spans.push_back({off[0], off[1], f.tensors.size()});
    f.tensors.push_back(std::move(t));
  }
  // The tensors tile the data exactly: no overlap, no hole, nothing after (the reference rule).
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.lo < b.lo; });
  uint64_t at = 0;
  for (const auto& s : spans) {
    if (s.lo != at)
      throw IoError(source + ": tensor '" + f.tensors[s.index].name + "' starts at data byte " + std::to_string(s.lo) +
                    ", expected " + std::to_string(at) + " (overlapping or gapped tensors)");
    at = s.hi;
  }
  if (at != data.size())
    throw IoError(source + ": " + std::to_string(data.size() - at) + " data bytes after the last tensor");
  return f;
}

std::string serialize(std::vector<TensorData> tensors, const std::vector<std::pair<std::string, std::string>>& metadata) {
  for (const auto& t : tensors) {
    if (!dtype_bytes(t.dtype)) throw Error("safetensors: unknown dtype '" + t.dtype + "' for " + t.name);
    size_t want = dtype_bytes(t.dtype);
    for (int64_t d : t.shape) want *= static_cast<size_t>(d);
    if (want != t.data.size())
      throw Error("safetensors: " + t.name + " has " + std::to_string(t.data.size()) + " bytes for its shape's " +
                  std::to_string(want));
  }
  std::set<std::string> names;
  for (const auto& t : tensors)
    if (t.name == "__metadata__" || !names.insert(t.name).second)
      throw Error("safetensors: the tensor name '" + t.name + "' is " +
                  (t.name == "__metadata__" ? "reserved for the metadata" : "given twice"));
  std::stable_sort(tensors.begin(), tensors.end(), [](const TensorData& a, const TensorData& b) {
    const int ra = dtype_rank(a.dtype), rb = dtype_rank(b.dtype);
    return ra != rb ? ra > rb : a.name < b.name;
  });
  // The reference writer's header: no spaces, __metadata__ first, then the tensors in the order
  // above with their offsets into the data; ordered_json keeps that order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = std::move(m);
  }
  size_t at = 0;
  for (const auto& t : tensors) {
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {at, at + t.data.size()}}};
    at += t.data.size();
  }
  std::string h;
  try {
    h = header.dump();
  } catch (const nlohmann::json::type_error& e) {  // a name that is not UTF-8
    throw Error(std::string("safetensors: a tensor or metadata name is not UTF-8 text (") + e.what() + ")");
  }
  h.append((8 - h.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = h.size();
  for (int k = 0; k < 8; ++k) out[k] = static_cast<char>((n >> (8 * k)) & 0xff);
  out += h;
  out.reserve(out.size() + at);
  for (const auto& t : tensors) out += t.data;
  return out;
}

}  // namespace replica::safetensors
