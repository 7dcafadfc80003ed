// The measurement behind the JSON library choice (docs/formats.md): time to read a ResNet-50
// safetensors header (320 tensors) with replica's reader (nlohmann-json plus the reference rules),
// nlohmann-json alone, and simdjson (DOM and on-demand). Built only when libsimdjson-dev is
// installed; replica itself does not use simdjson.
//   build/bench/replica_bench_json [FILE.safetensors]   (default: the ResNet-50 test fixture)
#include <simdjson.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "core/file_io.h"
#include "core/json.h"
#include "core/safetensors.h"

namespace {
template <class F>
void time_it(const char* what, F&& f) {
  double best = 1e30;
  for (int round = 0; round < 5; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    size_t sink = 0;
    for (int i = 0; i < 200; ++i) sink += f();
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 200;
    best = std::min(best, us);
    if (sink == 0) std::printf("(nothing read)\n");
  }
  std::printf("| %-44s | %9.1f |\n", what, best);
}
}  // namespace

int main(int argc, char** argv) {
  const std::string path =
      argc > 1 ? argv[1] : std::string(REPLICA_SOURCE_DIR) + "/tests/fixtures/resnet50w8_torch.safetensors";
  const std::string bytes = replica::read_file(path, "the safetensors file");
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = n << 8 | static_cast<unsigned char>(bytes[static_cast<size_t>(k)]);
  const std::string header = bytes.substr(8, n);
  std::printf("%s: header of %zu bytes\n\n| reader | us per header (best of 5 x 200) |\n|---|---|\n", path.c_str(),
              header.size());
  time_it("replica safetensors::parse (whole file check)", [&] { return replica::safetensors::parse(bytes, path).tensors.size(); });
  time_it("nlohmann::json::parse", [&] { return nlohmann::json::parse(header).size(); });
  time_it("nlohmann::ordered_json::parse", [&] { return nlohmann::ordered_json::parse(header).size(); });
  simdjson::dom::parser dom;
  time_it("simdjson DOM (with the padded copy)", [&] {
    const simdjson::padded_string p(header);
    return static_cast<size_t>(dom.parse(p).get_object().size());
  });
  simdjson::ondemand::parser od;
  time_it("simdjson on-demand (every tensor's fields)", [&] {
    simdjson::padded_string p(header);
    auto doc = od.iterate(p);
    size_t fields = 0;
    for (auto tensor : doc.get_object())
      for (auto field : tensor.value().get_object()) fields += field.unescaped_key().value().size() > 0;
    return fields;
  });
  return 0;
}
