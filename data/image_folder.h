// Image data sets of encoded files: a class-folder tree (torchvision's ImageFolder layout,
// ROOT/<class>/<image>.jpg|png; classes are the sorted folder names) and the packed form of one
// (data/image_pack.h). Both decode and transform with the ImageNet recipe (image_transforms.h):
// random resized crop + flip for training, resize + centre crop for evaluation, at
// data.image_size. A file that does not decode is an error naming it, or with skip_bad_files a
// warning naming it and the next readable image of the same class in its place.
#pragma once
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "data/dataset.h"
#include "data/image_transforms.h"

namespace replica::data {

struct ImageRecipe {
  int image_size = 224;
  int eval_resize = 0;  // shorter side before the centre crop; 0: image_size / 0.875 (256 for 224)
  CropRecipe crop;
  bool hflip = true;
  bool skip_bad_files = false;
};

class EncodedImageDataset : public Dataset {
 public:
  Shape sample_shape() const override { return {recipe_.image_size, recipe_.image_size, 3}; }
  int64_t size() const override { return static_cast<int64_t>(labels_.size()); }
  int64_t classes() const override { return static_cast<int64_t>(class_names_.size()); }
  const std::vector<std::string>& class_names() const { return class_names_; }
  int32_t label(int64_t i) const { return labels_[static_cast<size_t>(i)]; }
  int32_t get(int64_t index, float* out) const override { return load(index, out, nullptr); }
  bool own_augmentation() const override { return true; }
  int32_t get_train(int64_t index, float* out, uint64_t key) const override;
  int64_t skipped_files(std::string* first = nullptr) const override;
  // The encoded bytes of sample i (`storage` holds them when they had to be read) and its name.
  virtual std::string_view bytes(int64_t i, std::string& storage) const = 0;
  virtual std::string source(int64_t i) const = 0;

 protected:
  std::vector<std::string> class_names_;
  std::vector<int32_t> labels_;  // sorted by class: each class is one run of indices
  ImageRecipe recipe_;

 private:
  int32_t load(int64_t i, float* out, const KeyedRandom* rng) const;
  void transform(int64_t i, float* out, const KeyedRandom* rng) const;
  mutable std::mutex bad_mu_;
  mutable std::set<int64_t> bad_;
};

class FolderDataset : public EncodedImageDataset {
 public:
  // `dir` holds one folder per class. Throws IoError naming what is missing or empty.
  FolderDataset(const std::string& dir, ImageRecipe recipe, std::string name = "folder");
  std::string name() const override { return name_; }
  std::string_view bytes(int64_t i, std::string& storage) const override;
  std::string source(int64_t i) const override { return files_[static_cast<size_t>(i)]; }
  const std::vector<std::string>& files() const { return files_; }

 private:
  std::string name_;
  std::vector<std::string> files_;
};

// "a, b (+3 more)": the classes one list has and the other lacks, for error messages.
std::string class_difference(const std::vector<std::string>& a, const std::vector<std::string>& b);

}  // namespace replica::data
