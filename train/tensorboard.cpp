// Event-file encoding. Event { double wall_time = 1; int64 step = 2; string file_version = 3;
// Summary summary = 5; }  Summary { repeated Value value = 1; }  Value { string tag = 1;
// float simple_value = 2; }
#include "train/tensorboard.h"

#include <array>
#include <chrono>
#include <cstring>

#include "core/errors.h"

namespace replica::train {

namespace {
std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}
uint32_t masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }
void varint(std::string& s, uint64_t v) {
  while (v >= 0x80) {
    s.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  s.push_back(static_cast<char>(v));
}
void bytes_field(std::string& s, int field, const std::string& b) {
  varint(s, static_cast<uint64_t>(field) << 3 | 2);
  varint(s, b.size());
  s += b;
}
double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
std::string event_header(double wall, int64_t step) {
  std::string e;
  e.push_back(0x09);  // wall_time, fixed64
  e.append(reinterpret_cast<const char*>(&wall), 8);
  e.push_back(0x10);  // step, varint
  varint(e, static_cast<uint64_t>(step));
  return e;
}
}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  static const auto table = make_table();
  uint32_t c = 0xffffffffu;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  path_ = dir + "/events.out.tfevents." + std::to_string(static_cast<int64_t>(now_seconds())) + ".replica";
  out_.open(path_, std::ios::binary | std::ios::trunc);
  if (!out_) throw IoError(path_ + ": cannot create the TensorBoard event file");
  std::string e = event_header(now_seconds(), 0);
  bytes_field(e, 3, "brain.Event:2");
  record(e);
}

void TensorBoardWriter::record(const std::string& data) {
  uint64_t len = data.size();
  uint32_t lcrc = masked(crc32c(&len, 8)), dcrc = masked(crc32c(data.data(), data.size()));
  out_.write(reinterpret_cast<const char*>(&len), 8);
  out_.write(reinterpret_cast<const char*>(&lcrc), 4);
  out_.write(data.data(), static_cast<std::streamsize>(data.size()));
  out_.write(reinterpret_cast<const char*>(&dcrc), 4);
}

void TensorBoardWriter::scalar(const std::string& tag, float value, int64_t step) {
  std::string v;
  bytes_field(v, 1, tag);
  v.push_back(0x15);  // simple_value, fixed32
  v.append(reinterpret_cast<const char*>(&value), 4);
  std::string summary;
  bytes_field(summary, 1, v);
  std::string e = event_header(now_seconds(), step);
  bytes_field(e, 5, summary);
  record(e);
}

}  // namespace replica::train
