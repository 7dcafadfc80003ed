// Datasets held in memory as u8 images [N,H,W,C] with i32 labels: IDX (MNIST, Fashion-MNIST; gzip
// or raw), CIFAR-10/100 binary, and synthetic data of any shape for benchmarks. Readers check
// every header and size and name the file and what is wrong.
#pragma once
#include <cstdint>
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/shape.h"

namespace replica::data {

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual std::string name() const = 0;
  virtual int64_t size() const = 0;
  virtual Shape sample_shape() const = 0;  // [H,W,C]
  virtual int64_t classes() const = 0;
  // Writes sample `index` as floats in [0,1] (HWC) and returns its label.
  virtual int32_t get(int64_t index, float* out) const = 0;
  // Data sets with a recipe of their own (image folders: random resized crop and flip) write a
  // training sample drawn from `key` here; the loader's pad-crop and flip are for the others.
  virtual bool own_augmentation() const { return false; }
  virtual int32_t get_train(int64_t index, float* out, uint64_t key) const {
    (void)key;
    return get(index, out);
  }
  // Unreadable files replaced so far (data.skip_bad_files), and the first one's name.
  virtual int64_t skipped_files(std::string* first = nullptr) const {
    (void)first;
    return 0;
  }
};

// Images kept as bytes (60k Fashion-MNIST images take 47 MB).
class InMemoryDataset : public Dataset {
 public:
  InMemoryDataset(std::string name, Shape sample, int64_t classes, std::vector<uint8_t> images,
                  std::vector<int32_t> labels);
  std::string name() const override { return name_; }
  int64_t size() const override { return static_cast<int64_t>(labels_.size()); }
  Shape sample_shape() const override { return sample_; }
  int64_t classes() const override { return classes_; }
  int32_t get(int64_t index, float* out) const override;
  const std::vector<int32_t>& labels() const { return labels_; }

 private:
  std::string name_;
  Shape sample_;
  int64_t classes_;
  std::vector<uint8_t> images_;
  std::vector<int32_t> labels_;
};

// Random images (fixed per index) and labels; `size` samples.
class SyntheticDataset : public Dataset {
 public:
  SyntheticDataset(Shape sample, int64_t classes, int64_t size, uint64_t seed = 0);
  std::string name() const override { return "synthetic"; }
  int64_t size() const override { return size_; }
  Shape sample_shape() const override { return sample_; }
  int64_t classes() const override { return classes_; }
  int32_t get(int64_t index, float* out) const override;

 private:
  Shape sample_;
  int64_t classes_, size_;
  uint64_t seed_;
};

// The first `n` samples of another data set (for quick runs: data.limit_train / limit_test).
class SubsetDataset : public Dataset {
 public:
  SubsetDataset(std::shared_ptr<const Dataset> base, int64_t n)
      : base_(std::move(base)), n_(std::min(n, base_->size())) {}
  std::string name() const override { return base_->name() + "[:" + std::to_string(n_) + "]"; }
  int64_t size() const override { return n_; }
  Shape sample_shape() const override { return base_->sample_shape(); }
  int64_t classes() const override { return base_->classes(); }
  int32_t get(int64_t index, float* out) const override { return base_->get(index, out); }
  bool own_augmentation() const override { return base_->own_augmentation(); }
  int32_t get_train(int64_t index, float* out, uint64_t key) const override { return base_->get_train(index, out, key); }
  int64_t skipped_files(std::string* first = nullptr) const override { return base_->skipped_files(first); }
  const Dataset& base() const { return *base_; }

 private:
  std::shared_ptr<const Dataset> base_;
  int64_t n_;
};

// Reads a whole file, gunzipping when it starts with the gzip magic. Throws IoError naming it.
std::vector<uint8_t> read_file_maybe_gz(const std::string& path);
// The same on bytes in memory: gunzipped when they start with the gzip magic, else returned as
// they are. A stream that inflates past `limit` bytes is an error (a gzip bomb is not a data set).
std::vector<uint8_t> maybe_gunzip(std::vector<uint8_t> raw, const std::string& source,
                                  size_t limit = size_t(16) << 30);

// The parsers behind the loaders, on bytes in memory (`source` names them in errors). Every
// count in a header is checked, without overflow, against the bytes that are there.
struct IdxImages {
  uint32_t count = 0, rows = 0, cols = 0;
  std::vector<uint8_t> pixels;  // count x rows x cols
};
IdxImages parse_idx_images(std::vector<uint8_t> bytes, const std::string& source);
std::vector<int32_t> parse_idx_labels(const std::vector<uint8_t>& bytes, const std::string& source);
// One CIFAR-10 binary batch: records of 1 label byte + 3072 planar RGB bytes; appends HWC images.
void parse_cifar10_batch(const std::vector<uint8_t>& bytes, const std::string& source, std::vector<uint8_t>& images,
                         std::vector<int32_t>& labels);

// IDX pair (images idx3 + labels idx1), e.g. train-images-idx3-ubyte(.gz).
std::unique_ptr<InMemoryDataset> load_idx(const std::string& images_path,
                                          const std::string& labels_path, const std::string& name);
// "train" or "test" split of an MNIST-layout directory (looks for .gz then raw files).
std::unique_ptr<InMemoryDataset> load_mnist_dir(const std::string& dir, const std::string& split,
                                                const std::string& name);
// CIFAR-10 binary batches (data_batch_1..5.bin / test_batch.bin) in `dir`.
std::unique_ptr<InMemoryDataset> load_cifar10_dir(const std::string& dir, const std::string& split);

}  // namespace replica::data
