// safetensors reading (a small strict JSON parser for its header) and writing.
#include "core/safetensors.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "core/errors.h"

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

// A JSON reader for exactly what the header holds: objects, arrays, strings and non-negative
// integers. Anything else is an error with the byte position.
class Json {
 public:
  Json(std::string_view s, const std::string& source) : s_(s), source_(source) {}
  [[noreturn]] void fail(const std::string& what) const {
    throw IoError(source_ + ": safetensors header, byte " + std::to_string(i_) + ": " + what);
  }
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  bool peek(char c) {
    ws();
    return i_ < s_.size() && s_[i_] == c;
  }
  void expect(char c) {
    ws();
    if (i_ >= s_.size() || s_[i_] != c) fail(std::string("expected '") + c + "'");
    ++i_;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail("unterminated string");
      const char c = s_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("unterminated escape");
      const char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          if (i_ + 4 > s_.size()) fail("short \\u escape");
          unsigned v = 0;
          for (int k = 0; k < 4; ++k) {
            const char h = s_[i_++];
            v = v * 16 + (h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10
                          : h >= 'A' && h <= 'F' ? h - 'A' + 10 : (fail("bad \\u escape"), 0));
          }
          if (v >= 0xD800 && v <= 0xDFFF) fail("surrogate \\u escapes are not supported in names");
          if (v < 0x80) out += static_cast<char>(v);
          else if (v < 0x800) out += static_cast<char>(0xC0 | (v >> 6)), out += static_cast<char>(0x80 | (v & 63));
          else
            out += static_cast<char>(0xE0 | (v >> 12)), out += static_cast<char>(0x80 | ((v >> 6) & 63)),
                out += static_cast<char>(0x80 | (v & 63));
          break;
        }
        default: fail(std::string("bad escape \\") + e);
      }
    }
  }
  uint64_t integer() {
    ws();
    if (i_ >= s_.size() || s_[i_] < '0' || s_[i_] > '9') fail("expected a non-negative integer");
    uint64_t v = 0;
    while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
      const uint64_t d = static_cast<uint64_t>(s_[i_++] - '0');
      if (v > (UINT64_MAX - d) / 10) fail("integer too large");
      v = v * 10 + d;
    }
    return v;
  }
  std::vector<uint64_t> integers() {
    std::vector<uint64_t> v;
    expect('[');
    if (peek(']')) return ++i_, v;
    do v.push_back(integer());
    while (comma());
    expect(']');
    return v;
  }
  bool comma() {
    if (!peek(',')) return false;
    ++i_;
    return true;
  }
  void end() {
    ws();
    if (i_ != s_.size()) fail("text after the header's object");
  }

 private:
  std::string_view s_;
  const std::string& source_;
  size_t i_ = 0;
};

void put_json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    if (c == '"') out += "\\\"";
    else if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c == '\b') out += "\\b";
    else if (c == '\f') out += "\\f";
    else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '"';
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
  Json j(bytes.substr(8, n), source);
  const std::string_view data = bytes.substr(8 + n);
  File f;
  std::set<std::string> seen;
  struct Span {
    uint64_t lo, hi;
    size_t index;
  };
  std::vector<Span> spans;
  j.expect('{');
  if (!j.peek('}')) do {
      const std::string name = j.string();
      j.expect(':');
      if (!seen.insert(name).second) j.fail("'" + name + "' appears twice");
      j.expect('{');
      if (name == "__metadata__") {
        if (!j.peek('}')) do {
            std::string k = j.string();
            j.expect(':');
            f.metadata.emplace_back(std::move(k), j.string());
          } while (j.comma());
        j.expect('}');
        continue;
      }
      TensorView t;
      t.name = name;
      bool has_dtype = false, has_shape = false, has_offsets = false;
      std::vector<uint64_t> off;
      if (!j.peek('}')) do {
          const std::string k = j.string();
          j.expect(':');
          if (k == "dtype") t.dtype = j.string(), has_dtype = true;
          else if (k == "shape") {
            for (uint64_t d : j.integers()) {
              if (d > (uint64_t(1) << 48)) j.fail("'" + name + "': dimension " + std::to_string(d) + " is too large");
              t.shape.push_back(static_cast<int64_t>(d));
            }
            has_shape = true;
          } else if (k == "data_offsets") off = j.integers(), has_offsets = true;
          else j.fail("'" + name + "': unknown field '" + k + "'");
        } while (j.comma());
      j.expect('}');
      if (!has_dtype || !has_shape || !has_offsets) j.fail("'" + name + "' needs dtype, shape and data_offsets");
      const size_t es = dtype_bytes(t.dtype);
      if (!es) j.fail("'" + name + "': unknown dtype '" + t.dtype + "'");
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
    } while (j.comma());
  j.expect('}');
  j.end();
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
  std::stable_sort(tensors.begin(), tensors.end(), [](const TensorData& a, const TensorData& b) {
    const int ra = dtype_rank(a.dtype), rb = dtype_rank(b.dtype);
    return ra != rb ? ra > rb : a.name < b.name;
  });
  std::string h = "{";
  if (!metadata.empty()) {
    h += "\"__metadata__\":{";
    for (size_t i = 0; i < metadata.size(); ++i) {
      if (i) h += ',';
      put_json_string(h, metadata[i].first);
      h += ':';
      put_json_string(h, metadata[i].second);
    }
    h += "}";
  }
  size_t at = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (i || !metadata.empty()) h += ',';
    put_json_string(h, t.name);
    h += ":{\"dtype\":";
    put_json_string(h, t.dtype);
    h += ",\"shape\":[";
    for (size_t k = 0; k < t.shape.size(); ++k) h += (k ? "," : "") + std::to_string(t.shape[k]);
    h += "],\"data_offsets\":[" + std::to_string(at) + "," + std::to_string(at + t.data.size()) + "]}";
    at += t.data.size();
  }
  h += "}";
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
