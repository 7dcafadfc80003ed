// The bodies of the fuzz targets, one function per reader of outside bytes. libFuzzer calls them
// from tests/fuzz/fuzz_*.cpp; the normal suite (test_fuzz_regressions) replays every committed
// seed and every past finding through the same functions. Each returns normally for any input:
// a parsed value or the reader's own error type; anything else (a crash, a sanitizer report,
// another exception) is a finding.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/errors.h"
#include "core/safetensors.h"
#include "data/dataset.h"
#include "data/image_codec.h"
#include "data/image_pack.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/model_io.h"

namespace replica::fuzz {

inline void checkpoint(const uint8_t* data, size_t size) {
  try {
    auto c = train::parse_checkpoint(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.ckpt");
    // What a resume reads next: the numbers of the meta section, checked.
    for (const char* key : {"global_step", "epoch", "step_in_epoch", "world", "num_params", "optimizer_steps"}) {
      try {
        c.meta_int(key, 0, int64_t(1) << 53);
      } catch (const IoError&) {
      }
    }
  } catch (const IoError&) {
  }
}

inline void model_file(const uint8_t* data, size_t size) {
  try {
    auto m = train::parse_model_file(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.bin");
    // Touch every byte the reader promised is there (ASan reports a view past the buffer).
    volatile unsigned char sink = 0;
    for (char c : m.params) sink = sink ^ static_cast<unsigned char>(c);
    for (char c : m.buffers) sink = sink ^ static_cast<unsigned char>(c);
  } catch (const IoError&) {
  }
}

inline void safetensors_file(const uint8_t* data, size_t size) {
  try {
    auto f = safetensors::parse(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.safetensors");
    volatile unsigned char sink = 0;
    for (const auto& t : f.tensors)
      for (char c : t.data) sink = sink ^ static_cast<unsigned char>(c);
    // What was read writes back to a file that reads again (the writer's own checks hold).
    std::vector<safetensors::TensorData> ts;
    for (const auto& t : f.tensors) ts.push_back({t.name, t.dtype, t.shape, std::string(t.data)});
    const std::string again = safetensors::serialize(std::move(ts), f.metadata);
    safetensors::parse(again, "fuzz.safetensors (written back)");
  } catch (const IoError&) {
  }
}

inline void image(const uint8_t* data, size_t size) {
  const std::string_view b(reinterpret_cast<const char*>(data), size);
  try {
    int w = 0, h = 0;
    data::image_size(b, "fuzz.img", w, h);
    if (static_cast<int64_t>(w) * h > (int64_t(1) << 22)) return;  // libFuzzer's memory limit, not the reader's
    data::RgbImage img = data::decode_image(b, "fuzz.img", w / 4, h / 4);
    volatile uint8_t sink = img.pixels.empty() ? 0 : img.pixels.back();
    (void)sink;
  } catch (const IoError&) {
  }
}

inline void pack(const uint8_t* data, size_t size) {
  try {
    const auto p = data::parse_pack(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.pack");
    volatile uint64_t sink = 0;
    for (const auto& it : p.items) sink = sink + static_cast<uint8_t>(data[it.offset + (it.size ? it.size - 1 : 0)]);
  } catch (const IoError&) {
  }
}

inline void idx(const uint8_t* data, size_t size) {
  try {
    // 64 MiB inflated at most: libFuzzer's memory limit, not the loader's (16 GiB).
    std::vector<uint8_t> bytes = data::maybe_gunzip(std::vector<uint8_t>(data, data + size), "fuzz.idx", size_t(64) << 20);
    try {
      data::IdxImages img = data::parse_idx_images(bytes, "fuzz-images");
      volatile uint8_t sink = img.pixels.empty() ? 0 : img.pixels.back();
      (void)sink;
    } catch (const IoError&) {
    }
    data::parse_idx_labels(bytes, "fuzz-labels");
  } catch (const IoError&) {
  }
}

inline void cifar(const uint8_t* data, size_t size) {
  std::vector<uint8_t> images;
  std::vector<int32_t> labels;
  try {
    data::parse_cifar10_batch(std::vector<uint8_t>(data, data + size), "fuzz.bin", images, labels);
  } catch (const IoError&) {
  }
}

// The first line is a --set argument (section.key=value), the rest a YAML file.
inline void config(const uint8_t* data, size_t size) {
  std::string in(reinterpret_cast<const char*>(data), size);
  const size_t nl = in.find('\n');
  std::vector<std::string> sets;
  std::string yaml = in;
  if (nl != std::string::npos) {
    sets.push_back(in.substr(0, nl));
    yaml = in.substr(nl + 1);
  }
  for (const auto& s : {sets, std::vector<std::string>{}}) {
    try {
      train::parse_config(yaml, "fuzz.yaml", s);
    } catch (const ConfigError&) {
    }
  }
}

}  // namespace replica::fuzz
