// Image files: JPEG and PNG of every colour kind decode to RGB by their bytes (not their names),
// damaged and empty files are errors naming them, DCT-domain scaling decodes no larger than
// needed, the ImageNet crop geometry is torchvision's, class folders and packed files read the
// same images, and every way a folder or a pack can be wrong is a clear error.
#include <gtest/gtest.h>
#include <png.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/errors.h"
#include "data/image_codec.h"
#include "data/image_folder.h"
#include "data/image_pack.h"
#include "data/image_transforms.h"

using namespace replica;
using namespace replica::data;
namespace fs = std::filesystem;

namespace {
std::vector<uint8_t> pattern(int w, int h, int channels) {
  std::vector<uint8_t> p(static_cast<size_t>(w) * h * channels);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int c = 0; c < channels; ++c)
        p[(static_cast<size_t>(y) * w + x) * channels + c] = static_cast<uint8_t>((x * 255 / std::max(1, w - 1) + c * 60 + y) % 256);
  return p;
}
void write(const std::string& path, const std::string& bytes) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}
std::string fresh_dir(const std::string& name) {
  const std::string d = ::testing::TempDir() + "replica_images_" + name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}
double mean_abs_diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += std::abs(int(a[i]) - int(b[i]));
  return s / a.size();
}
std::string error_of(const std::string& bytes, const std::string& name) {
  try {
    decode_image(bytes, name);
  } catch (const IoError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(ImageCodec, EveryColourKindDecodesToRgb) {
  const int w = 37, h = 23;  // odd sizes: chroma subsampling edges
  const auto rgb = pattern(w, h, 3);
  RgbImage j = decode_image(encode_jpeg(rgb.data(), w, h, 95), "rgb.jpg");
  ASSERT_EQ(j.width, w);
  ASSERT_EQ(j.height, h);
  // 4:2:0 chroma on a pattern with hard colour edges: 7.8 measured
  EXPECT_LT(mean_abs_diff(j.pixels, rgb), 10.0) << "JPEG at quality 95 stays close";

  const auto gray = pattern(w, h, 1);
  RgbImage g = decode_image(encode_jpeg_gray(gray.data(), w, h, 95), "gray.jpg");
  for (size_t p = 0; p < gray.size(); ++p) {
    ASSERT_EQ(g.pixels[3 * p], g.pixels[3 * p + 1]) << "grayscale: equal channels";
    ASSERT_EQ(g.pixels[3 * p], g.pixels[3 * p + 2]);
  }

  // CMYK as Photoshop stores it (inverted: 255 = no ink): no cyan, full magenta and yellow, no
  // black is red.
  std::vector<uint8_t> cmyk(static_cast<size_t>(w) * h * 4);
  for (size_t p = 0; p < cmyk.size() / 4; ++p) cmyk[4 * p] = 255, cmyk[4 * p + 1] = 0, cmyk[4 * p + 2] = 0, cmyk[4 * p + 3] = 255;
  RgbImage c = decode_image(encode_jpeg_cmyk(cmyk.data(), w, h, 95), "cmyk.jpg");
  EXPECT_GT(c.pixels[0], 240);
  EXPECT_LT(c.pixels[1], 15);
  EXPECT_LT(c.pixels[2], 15);

  for (int ch : {1, 2, 3, 4}) {
    const auto px = pattern(w, h, ch);
    RgbImage p = decode_image(encode_png(px.data(), w, h, ch), "p.png");
    ASSERT_EQ(p.width, w);
    for (size_t i = 0; i < static_cast<size_t>(w) * h; ++i) {
      ASSERT_EQ(p.pixels[3 * i], px[i * ch]) << ch << " channels: exact (lossless, alpha dropped)";
      if (ch >= 3) {
        ASSERT_EQ(p.pixels[3 * i + 2], px[i * ch + 2]);
      } else {
        ASSERT_EQ(p.pixels[3 * i + 2], px[i * ch]) << "gray: the same in every channel";
      }
    }
  }
}

// A palette PNG (written with libpng's colour-map format) decodes to its palette's colours.
TEST(ImageCodec, PalettePngsDecodeToTheirColours) {
  png_image im;
  std::memset(&im, 0, sizeof im);
  im.version = PNG_IMAGE_VERSION;
  im.width = 4;
  im.height = 2;
  im.format = PNG_FORMAT_RGB_COLORMAP;
  im.colormap_entries = 3;
  const uint8_t colormap[] = {255, 0, 0, 0, 255, 0, 10, 20, 30};
  const uint8_t index[] = {0, 1, 2, 0, 2, 2, 1, 0};
  png_alloc_size_t size = 0;
  ASSERT_TRUE(png_image_write_to_memory(&im, nullptr, &size, 0, index, 0, colormap));
  std::string bytes(size, '\0');
  ASSERT_TRUE(png_image_write_to_memory(&im, bytes.data(), &size, 0, index, 0, colormap));
  bytes.resize(size);
  const RgbImage img = decode_image(bytes, "palette.png");
  ASSERT_EQ(img.width, 4);
  for (int p = 0; p < 8; ++p)
    for (int c = 0; c < 3; ++c) EXPECT_EQ(img.pixels[3 * p + c], colormap[3 * index[p] + c]) << "pixel " << p;
}

TEST(ImageCodec, TheKindComesFromTheBytesAndDamageIsNamed) {
  const auto px = pattern(16, 16, 3);
  const std::string png = encode_png(px.data(), 16, 16, 3);
  EXPECT_EQ(decode_image(png, "really-a-png.jpg").width, 16) << "a .jpg name holding PNG bytes is read as PNG";
  EXPECT_NE(error_of("", "zero.jpg").find("zero.jpg: empty file"), std::string::npos);
  EXPECT_NE(error_of("hello, not an image", "notes.png").find("neither JPEG nor PNG"), std::string::npos);
  const std::string jpeg = encode_jpeg(px.data(), 16, 16, 90);
  const std::string m = error_of(jpeg.substr(0, 20), "cut.jpg");
  EXPECT_NE(m.find("cut.jpg: not a readable JPEG"), std::string::npos) << "[" << m << "]";
  EXPECT_NE(error_of(png.substr(0, 40), "cut.png").find("cut.png"), std::string::npos);
}

TEST(ImageCodec, JpegsDecodeInTheDctDomainNoLargerThanNeeded) {
  const auto px = pattern(512, 384, 3);
  const std::string jpeg = encode_jpeg(px.data(), 512, 384, 90);
  RgbImage full = decode_image(jpeg, "a.jpg");
  EXPECT_EQ(full.width, 512);
  RgbImage quarter = decode_image(jpeg, "a.jpg", 100, 90);
  EXPECT_EQ(quarter.width, 128) << "1/4 still covers 100x90";
  EXPECT_EQ(quarter.height, 96);
  EXPECT_EQ(quarter.full_width, 512);
  RgbImage some = decode_image(jpeg, "a.jpg", 300, 10);
  EXPECT_GE(some.width, 300);
  EXPECT_LT(some.width, 512);
}

TEST(ImageTransforms, RandomResizedCropIsTorchvisionsAndReproducible) {
  CropRecipe r;
  for (uint64_t key = 0; key < 500; ++key) {
    KeyedRandom a(key), b(key);
    const CropBox x = random_resized_crop(500, 375, r, a), y = random_resized_crop(500, 375, r, b);
    ASSERT_EQ(x.x, y.x);
    ASSERT_EQ(x.w, y.w);
    ASSERT_GE(x.x, 0);
    ASSERT_GE(x.y, 0);
    ASSERT_LE(x.x + x.w, 500);
    ASSERT_LE(x.y + x.h, 375);
    const double area = x.w * x.h / (500.0 * 375);
    EXPECT_GE(area, 0.07);
    EXPECT_LE(area, 1.0);
    const double ratio = x.w / x.h;
    EXPECT_GE(ratio, 0.74);
    EXPECT_LE(ratio, 1.35);
  }
  KeyedRandom k(3);
  const CropBox thin = random_resized_crop(1000, 10, r, k);  // no try fits: the centred fallback
  EXPECT_EQ(thin.h, 10);
  EXPECT_NEAR(thin.w, 13, 0.5) << "cut to the largest allowed ratio, 4/3";
  EXPECT_NEAR(thin.x, (1000 - thin.w) / 2, 1);
  const CropBox eval = center_crop(320, 240, 256, 224);  // Resize(256) then CenterCrop(224)
  EXPECT_NEAR(eval.h, 240 * 224.0 / 256, 1e-9);
  EXPECT_NEAR(eval.x, (320 - eval.w) / 2, 1e-9);
}

TEST(ImageTransforms, ResamplingKeepsFlatRegionsAndMirrors) {
  RgbImage img;
  img.width = img.full_width = 64;
  img.height = img.full_height = 48;
  img.pixels.assign(64 * 48 * 3, 200);
  std::vector<float> out(20 * 20 * 3);
  resample(img, {5, 3, 50, 40}, 20, 20, false, out.data());
  for (float v : out) ASSERT_NEAR(v, 200 / 255.f, 1e-5);
  for (int y = 0; y < 48; ++y)
    for (int x = 0; x < 64; ++x) img.pixels[(y * 64 + x) * 3] = static_cast<uint8_t>(x < 32 ? 0 : 255);
  std::vector<float> a(16 * 16 * 3), b(16 * 16 * 3);
  resample(img, {0, 0, 64, 48}, 16, 16, false, a.data());
  resample(img, {0, 0, 64, 48}, 16, 16, true, b.data());
  for (int y = 0; y < 16; ++y)
    for (int x = 0; x < 16; ++x) ASSERT_FLOAT_EQ(a[(y * 16 + x) * 3], b[(y * 16 + 15 - x) * 3]);
  EXPECT_LT(a[0], 0.01f);
  EXPECT_GT(a[15 * 3], 0.99f);
}

namespace {
// class "b" has 3 images, "a" 2 (one of them PNG bytes named .jpg), "c" 1: sorted a, b, c.
std::string make_tree(const std::string& name) {
  const std::string d = fresh_dir(name);
  const auto px = pattern(40, 30, 3);
  write(d + "/b/1.jpg", encode_jpeg(px.data(), 40, 30, 90));
  write(d + "/b/2.JPEG", encode_jpeg(px.data(), 40, 30, 90));
  write(d + "/b/sub/3.png", encode_png(px.data(), 40, 30, 3));
  write(d + "/a/x.jpg", encode_png(px.data(), 40, 30, 3));
  write(d + "/a/y.jpg", encode_jpeg(px.data(), 40, 30, 90));
  write(d + "/a/notes.txt", "not an image");
  write(d + "/a/.hidden.jpg", "");
  write(d + "/c/z.png", encode_png(px.data(), 40, 30, 3));
  return d;
}
}  // namespace

TEST(FolderDataset, ClassesAreTheSortedFoldersAndEveryImageReads) {
  const std::string d = make_tree("tree");
  ImageRecipe r;
  r.image_size = 24;
  FolderDataset ds(d, r);
  EXPECT_EQ(ds.class_names(), (std::vector<std::string>{"a", "b", "c"}));
  ASSERT_EQ(ds.size(), 6);
  EXPECT_EQ(ds.label(0), 0);
  EXPECT_EQ(ds.label(2), 1);
  EXPECT_EQ(ds.label(5), 2);
  EXPECT_EQ(ds.sample_shape(), (Shape{24, 24, 3}));
  std::vector<float> out(24 * 24 * 3), again(out.size());
  for (int64_t i = 0; i < ds.size(); ++i) {
    EXPECT_EQ(ds.get(i, out.data()), ds.label(i));
    EXPECT_EQ(ds.get_train(i, again.data(), 42), ds.label(i));
    std::vector<float> third(out.size());
    ds.get_train(i, third.data(), 42);
    EXPECT_EQ(again, third) << "a training sample is a function of its key";
  }
}

TEST(FolderDataset, EveryWrongLayoutIsAClearError) {
  ImageRecipe r;
  auto error = [&](const std::string& dir) {
    try {
      FolderDataset ds(dir, r);
    } catch (const IoError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error("/nonexistent/train").find("not a directory"), std::string::npos);
  const std::string empty = fresh_dir("empty");
  EXPECT_NE(error(empty).find("no class folders"), std::string::npos);
  const std::string d = make_tree("empty_class");
  fs::create_directories(d + "/d_empty");
  std::ofstream(d + "/d_empty/readme.txt") << "x";
  const std::string m = error(d);
  EXPECT_NE(m.find("d_empty: a class folder with no"), std::string::npos) << m;
}

TEST(FolderDataset, ABadFileIsAnErrorOrWithSkipReplacedWithinItsClass) {
  const std::string d = make_tree("bad");
  const char broken[] = "\xFF\xD8\xFF\xE0 truncated";  // a JPEG's first bytes, then nothing
  write(d + "/b/0_broken.jpg", std::string(broken, sizeof broken - 1));
  ImageRecipe r;
  r.image_size = 16;
  std::vector<float> out(16 * 16 * 3);
  FolderDataset strict(d, r);
  ASSERT_EQ(strict.source(2).substr(strict.source(2).size() - 12), "0_broken.jpg");
  try {
    strict.get(2, out.data());
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("0_broken.jpg"), std::string::npos) << e.what();
  }
  r.skip_bad_files = true;
  FolderDataset lenient(d, r);
  EXPECT_EQ(lenient.get(2, out.data()), 1) << "the label stays the broken file's class";
  std::string first;
  EXPECT_EQ(lenient.skipped_files(&first), 1);
  EXPECT_NE(first.find("0_broken.jpg"), std::string::npos);
}

TEST(PackedDataset, PacksAndReadsTheSameImagesAndRefusesDamage) {
  const std::string d = make_tree("pack");
  ImageRecipe r;
  r.image_size = 24;
  FolderDataset folder(d, r);
  const std::string file = ::testing::TempDir() + "replica_images.pack";
  int64_t calls = 0;
  pack_images(folder, file, {.max_side = 64, .quality = 95, .threads = 2, .progress = [&](int64_t, int64_t) { calls++; }});
  EXPECT_GT(calls, 0);
  PackedDataset packed(file, r);
  EXPECT_EQ(packed.class_names(), folder.class_names());
  ASSERT_EQ(packed.size(), folder.size());
  std::vector<float> a(24 * 24 * 3), b(a.size());
  for (int64_t i = 0; i < folder.size(); ++i) {
    EXPECT_EQ(packed.label(i), folder.label(i));
    folder.get(i, a.data());
    packed.get(i, b.data());
    double diff = 0;
    for (size_t k = 0; k < a.size(); ++k) diff += std::fabs(a[k] - b[k]);
    EXPECT_LT(diff / a.size(), 0.03) << "image " << i << " (re-encoded at quality 95)";
  }
  std::ifstream in(file, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), {});
  auto error = [&](const std::string& damaged) {
    try {
      parse_pack(damaged, "x.pack");
    } catch (const IoError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error(bytes.substr(0, bytes.size() - 7)).find("truncated"), std::string::npos);
  std::string v2 = bytes;
  v2[8] = 2;
  EXPECT_NE(error(v2).find("pack version 2"), std::string::npos);
  std::string flipped = bytes;
  flipped[flipped.size() - 3] ^= 1;
  EXPECT_NE(error(flipped).find("checksum"), std::string::npos);
  EXPECT_NE(error("RPLPACK0" + bytes.substr(8)).find("not a replica image pack"), std::string::npos);
  EXPECT_THROW(PackedDataset("/nonexistent.pack", r), IoError);
}
