// Reads the golden fixtures written by tests/reference/make_reference.py.
#pragma once
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace replica::testing {

struct FixtureTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

inline std::map<std::string, FixtureTensor> load_fixture(const std::string& path,
                                                         std::vector<std::string>* order = nullptr) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open (run tests/reference/make_reference.py)");
  char magic[8];
  in.read(magic, 8);
  if (std::memcmp(magic, "RPLG0001", 8) != 0) throw std::runtime_error(path + ": bad magic");
  auto u32 = [&] {
    uint32_t v;
    in.read(reinterpret_cast<char*>(&v), 4);
    return v;
  };
  std::map<std::string, FixtureTensor> out;
  uint32_t n = u32();
  for (uint32_t i = 0; i < n; ++i) {
    std::string name(u32(), '\0');
    in.read(name.data(), static_cast<std::streamsize>(name.size()));
    FixtureTensor t;
    t.shape.resize(u32());
    in.read(reinterpret_cast<char*>(t.shape.data()), static_cast<std::streamsize>(t.shape.size() * 8));
    int64_t count = 1;
    for (auto d : t.shape) count *= d;
    t.data.resize(static_cast<size_t>(count));
    in.read(reinterpret_cast<char*>(t.data.data()), count * 4);
    if (!in) throw std::runtime_error(path + ": truncated at tensor " + name);
    if (order) order->push_back(name);
    out[name] = std::move(t);
  }
  return out;
}

}  // namespace replica::testing
