// Class-folder data sets: scanning, decoding with the recipe, replacing unreadable files.
#include "data/image_folder.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/errors.h"
#include "core/log.h"

namespace replica::data {

namespace fs = std::filesystem;

namespace {
bool image_name(const fs::path& p) {
  std::string e = p.extension().string();
  std::transform(e.begin(), e.end(), e.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return e == ".jpg" || e == ".jpeg" || e == ".png";
}
}  // namespace

int32_t EncodedImageDataset::get_train(int64_t index, float* out, uint64_t key) const {
  const KeyedRandom rng(key);
  return load(index, out, &rng);
}

void EncodedImageDataset::transform(int64_t i, float* out, const KeyedRandom* rng_in) const {
  std::string storage;
  const std::string_view b = bytes(i, storage);
  const std::string src = source(i);
  const int S = recipe_.image_size;
  int W = 0, H = 0;
  RgbImage img;
  const bool jpeg = sniff_image(b) == ImageKind::jpeg;
  if (jpeg) image_size(b, src, W, H);  // the header only: the crop decides how small to decode
  else {
    img = decode_image(b, src);
    W = img.width;
    H = img.height;
  }
  KeyedRandom rng = rng_in ? *rng_in : KeyedRandom(0);
  const CropBox box = rng_in ? random_resized_crop(W, H, recipe_.crop, rng)
                             : center_crop(W, H, recipe_.eval_resize ? recipe_.eval_resize
                                                                     : static_cast<int>(std::lround(S / 0.875)), S);
  const bool flip = rng_in && recipe_.hflip && (rng.next() & 1);
  if (jpeg) {  // DCT-domain downscaling while the crop still gets at least S pixels a side
    const int min_w = static_cast<int>(std::ceil(W * static_cast<double>(S) / std::max(box.w, 1.0)));
    const int min_h = static_cast<int>(std::ceil(H * static_cast<double>(S) / std::max(box.h, 1.0)));
    img = decode_image(b, src, std::min(min_w, W), std::min(min_h, H));
  }
  resample(img, box, S, S, flip, out);
}

int32_t EncodedImageDataset::load(int64_t i, float* out, const KeyedRandom* rng) const {
  try {
    transform(i, out, rng);
    return labels_[static_cast<size_t>(i)];
  } catch (const IoError& e) {
    if (!recipe_.skip_bad_files) throw;
    {
      std::lock_guard<std::mutex> lock(bad_mu_);
      if (bad_.insert(i).second) log_warn("data.skip_bad_files: ", e.what(), " (replaced by the next image of its class)");
    }
  }
  // The next readable image of the same class, so the label stays the file's (never a shift).
  const int32_t label = labels_[static_cast<size_t>(i)];
  const int64_t n = size();
  for (int64_t k = 1; k < n; ++k) {
    const int64_t j = (i + k) % n;
    if (labels_[static_cast<size_t>(j)] != label) continue;
    {
      std::lock_guard<std::mutex> lock(bad_mu_);
      if (bad_.count(j)) continue;
    }
    try {
      transform(j, out, rng);
      return label;
    } catch (const IoError& e) {
      std::lock_guard<std::mutex> lock(bad_mu_);
      if (bad_.insert(j).second) log_warn("data.skip_bad_files: ", e.what());
    }
  }
  throw IoError(source(i) + ": no readable image left in class '" + class_names_[static_cast<size_t>(label)] + "'");
}

int64_t EncodedImageDataset::skipped_files(std::string* first) const {
  std::lock_guard<std::mutex> lock(bad_mu_);
  if (first && !bad_.empty()) *first = source(*bad_.begin());
  return static_cast<int64_t>(bad_.size());
}

FolderDataset::FolderDataset(const std::string& dir, ImageRecipe recipe, std::string name) : name_(std::move(name)) {
  recipe_ = recipe;
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw IoError(dir + ": not a directory. An image-folder data set is DIR/train/<class>/<image> and "
                  "DIR/val/<class>/<image> (torchvision's ImageFolder layout); set data.path, or data.train_dir "
                  "and data.val_dir");
  std::vector<fs::path> classes;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_directory() && e.path().filename().string().front() != '.') classes.push_back(e.path());
  std::sort(classes.begin(), classes.end());
  if (classes.empty()) throw IoError(dir + ": no class folders in it (expected DIR/<class>/<image>.jpg)");
  for (size_t c = 0; c < classes.size(); ++c) {
    std::vector<std::string> images;
    for (const auto& e : fs::recursive_directory_iterator(classes[c]))
      if (e.is_regular_file() && e.path().filename().string().front() != '.' && image_name(e.path()))
        images.push_back(e.path().string());
    if (images.empty())
      throw IoError(classes[c].string() + ": a class folder with no .jpg, .jpeg or .png files; remove it or add images");
    std::sort(images.begin(), images.end());
    class_names_.push_back(classes[c].filename().string());
    for (auto& f : images) {
      files_.push_back(std::move(f));
      labels_.push_back(static_cast<int32_t>(c));
    }
  }
}

std::string_view FolderDataset::bytes(int64_t i, std::string& storage) const {
  const std::string& path = files_[static_cast<size_t>(i)];
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(path + ": cannot open it");
  storage.assign(std::istreambuf_iterator<char>(in), {});
  return storage;
}

std::string class_difference(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  std::vector<std::string> only;
  for (const auto& x : a)
    if (std::find(b.begin(), b.end(), x) == b.end()) only.push_back(x);
  std::string s;
  for (size_t i = 0; i < only.size() && i < 5; ++i) s += (i ? ", " : "") + only[i];
  if (only.size() > 5) s += " (+" + std::to_string(only.size() - 5) + " more)";
  return s.empty() ? "(none)" : s;
}

}  // namespace replica::data
