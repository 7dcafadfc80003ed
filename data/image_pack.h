// The packed form of an image-folder data set (FFCV's idea): one file holding the class table,
// every image re-encoded as a JPEG whose shorter side is at most max_side, and an index of
// offsets; memory-mapped at training time, so there is no per-file open and random access is a
// pointer. Layout (little-endian):
//   "RPLPACK1" | u32 version (1) | u32 classes | u64 images | u64 index_offset | u64 index_fnv1a
//   | classes x (u32 length, name) | JPEG bytes ... | index: images x (u64 offset, u32 size,
//   i32 label, u16 width, u16 height)
// Opening checks the magic, the version, the index's bounds and checksum and every entry.
#pragma once
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "data/image_folder.h"

namespace replica::data {

struct PackOptions {
  int max_side = 256;  // the shorter side is resized down to this (never up)
  int quality = 90;
  int threads = 0;  // 0: every core (replica pack), at least 1 everywhere
  // Called after each chunk with (done, total), from the calling thread.
  std::function<void(int64_t, int64_t)> progress;
};
// Packs `src` (in its order, with its class table) into `out_path`, atomically (a temporary file
// renamed when complete). Returns the file's size.
size_t pack_images(const FolderDataset& src, const std::string& out_path, const PackOptions& o);

class PackedDataset : public EncodedImageDataset {
 public:
  PackedDataset(const std::string& path, ImageRecipe recipe, std::string name = "packed");
  ~PackedDataset() override;
  PackedDataset(const PackedDataset&) = delete;
  PackedDataset& operator=(const PackedDataset&) = delete;
  std::string name() const override { return name_; }
  std::string_view bytes(int64_t i, std::string& storage) const override;
  std::string source(int64_t i) const override { return path_ + " image #" + std::to_string(i); }

 private:
  struct Entry {
    uint64_t offset;
    uint32_t size;
  };
  std::string name_, path_;
  const char* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<Entry> entries_;
};

// Writes a data set (any: IDX, CIFAR, synthetic) as a class-folder tree of JPEGs (or lossless
// PNGs), DIR/<label>/<index>.jpg|png (labels zero-padded so they sort as numbers), each image
// resized to size x size (0: as it is) and in RGB. For tests and benchmarks of the image
// pipeline on real pictures.
void write_image_folder(const Dataset& ds, const std::string& dir, int size, int quality, int threads = 1,
                        bool png = false);

// Parses the header and index of a pack in memory (the reader's checks; `source` names it).
struct PackIndex {
  std::vector<std::string> classes;
  struct Item {
    uint64_t offset;
    uint32_t size;
    int32_t label;
    uint16_t width, height;
  };
  std::vector<Item> items;
};
PackIndex parse_pack(std::string_view bytes, const std::string& source);

}  // namespace replica::data
