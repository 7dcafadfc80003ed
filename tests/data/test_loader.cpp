// Loader: shards disjoint and complete over an epoch, determinism from the seed, augmentation
// reproducible from (seed, epoch, index), and clear errors on bad files.
#include <gtest/gtest.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "core/errors.h"
#include "core/pools.h"
#include "data/dataset.h"
#include "data/loader.h"

using namespace replica;
using namespace replica::data;

TEST(Sharding, DisjointAndCompleteOverAnEpoch) {
  const int64_t N = 1000;
  Sharding sh(N, 8, 3, 4, 42, true);  // global batch 96
  EXPECT_EQ(sh.steps_per_epoch(), 10);
  std::set<int64_t> seen;
  int64_t total = 0;
  for (int64_t s = 0; s < sh.steps_per_epoch(); ++s)
    for (int r = 0; r < 4; ++r)
      for (int k = 0; k < 3; ++k)
        for (int64_t i : sh.indices(0, s, r, k)) {
          EXPECT_TRUE(seen.insert(i).second) << "index " << i << " given twice";
          EXPECT_GE(i, 0);
          EXPECT_LT(i, N);
          total++;
        }
  EXPECT_EQ(total, 960) << "every full global batch, the 40 left over dropped";
  // a permutation of all samples
  auto p = sh.permutation(0);
  std::set<int64_t> all(p.begin(), p.end());
  EXPECT_EQ(all.size(), static_cast<size_t>(N));
}

TEST(Sharding, DeterministicFromSeedAndEpoch) {
  Sharding a(500, 10, 1, 2, 7, true), b(500, 10, 1, 2, 7, true), c(500, 10, 1, 2, 8, true);
  EXPECT_EQ(a.indices(3, 5, 1, 0), b.indices(3, 5, 1, 0));
  EXPECT_NE(a.indices(3, 5, 1, 0), c.indices(3, 5, 1, 0)) << "another seed shuffles differently";
  EXPECT_NE(a.indices(3, 5, 1, 0), a.indices(4, 5, 1, 0)) << "each epoch reshuffles";
  Sharding plain(500, 10, 1, 2, 7, false);
  EXPECT_EQ(plain.indices(0, 1, 1, 0).front(), 30);
  EXPECT_THROW(Sharding(10, 8, 1, 2, 0, true), ConfigError) << "fewer samples than one global batch";
}

TEST(Loader, AugmentationIsReproducibleAndPrefetchDeliversInOrder) {
  auto ds = std::make_shared<SyntheticDataset>(Shape{6, 6, 2}, 5, 64);
  Sharding sh(64, 4, 2, 2, 1, true);
  PoolOptions po;
  auto pool = make_pool({DeviceKind::cpu, 0}, po);
  AugmentOptions aug{2, true, {0.5f, 0.5f}, {0.25f, 0.25f}};
  ReplicaLoader l1(*ds, sh, 1, *pool, aug, 9, 3), l2(*ds, sh, 1, *pool, aug, 9, 1);
  l1.begin_epoch(2, 1);
  l2.begin_epoch(2, 1);
  for (int64_t s = 1; s < sh.steps_per_epoch(); ++s)
    for (int k = 0; k < 2; ++k) {
      Batch a = l1.next(), b = l2.next();
      EXPECT_EQ(a.step, s);
      EXPECT_EQ(a.micro, k);
      ASSERT_EQ(a.n(), 4);
      EXPECT_EQ(0, std::memcmp(a.images.raw(), b.images.raw(), a.images.nbytes())) << "prefetch depth must not matter";
      auto idx = sh.indices(2, s, 1, k);
      for (int i = 0; i < 4; ++i) EXPECT_EQ(a.labels.data<int32_t>()[i], idx[i] % 5);
    }
  // Augmentation actually changes images (crop/flip), and normalisation applies.
  std::vector<float> plain(4 * 72), augd(4 * 72);
  std::vector<int32_t> lab(4);
  auto idx = sh.indices(0, 0, 0, 0);
  load_samples(*ds, idx, aug, false, 9, 0, plain.data(), lab.data());
  load_samples(*ds, idx, aug, true, 9, 0, augd.data(), lab.data());
  EXPECT_NE(plain, augd);
  std::vector<float> again(4 * 72);
  load_samples(*ds, idx, aug, true, 9, 0, again.data(), lab.data());
  EXPECT_EQ(augd, again);
}

TEST(Loader, SeveralWorkersAssembleTheSameBatches) {
  // GPU replicas split each micro-batch across threads; the batches must not change.
  auto ds = std::make_shared<SyntheticDataset>(Shape{7, 5, 3}, 10, 200);
  Sharding sh(200, 9, 1, 2, 3, true);
  PoolOptions po;
  auto pool = make_pool({DeviceKind::cpu, 0}, po);
  AugmentOptions aug{1, true, {0.5f, 0.5f, 0.5f}, {0.25f, 0.25f, 0.25f}};
  ReplicaLoader one(*ds, sh, 1, *pool, aug, 4, 2, 1), four(*ds, sh, 1, *pool, aug, 4, 2, 4);
  one.begin_epoch(1);
  four.begin_epoch(1);
  for (int64_t s = 0; s < sh.steps_per_epoch(); ++s) {
    Batch a = one.next(), b = four.next();
    ASSERT_EQ(a.n(), 9);
    EXPECT_EQ(0, std::memcmp(a.images.raw(), b.images.raw(), a.images.nbytes())) << "step " << s;
    EXPECT_EQ(0, std::memcmp(a.labels.raw(), b.labels.raw(), a.labels.nbytes())) << "step " << s;
  }
}

TEST(Readers, SyntheticSamplesAreDeterministicAndIndependent) {
  SyntheticDataset ds(Shape{8, 8, 3}, 10, 100, 1), other_seed(Shape{8, 8, 3}, 10, 100, 2);
  std::vector<float> a(192), b(192), c(192), d(192);
  EXPECT_EQ(ds.get(5, a.data()), 5);
  ds.get(5, b.data());
  ds.get(6, c.data());
  other_seed.get(5, d.data());
  EXPECT_EQ(a, b);
  double mean = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_GE(a[i], 0.f);
    EXPECT_LT(a[i], 1.f);
    mean += a[i] / a.size();
    // Neighbouring indices and seeds give unrelated samples, not shifted copies of one stream.
    if (i + 2 < a.size()) {
      EXPECT_NE(a[i + 2], c[i]);
    }
  }
  EXPECT_NE(a, c);
  EXPECT_NE(a, d);
  EXPECT_NEAR(mean, 0.5, 0.1);
}

namespace {
// Per test: ctest runs the tests of this file in parallel, and two of them write "lab".
std::string tmp(const std::string& name) {
  return ::testing::TempDir() + "/" + ::testing::UnitTest::GetInstance()->current_test_info()->name() + "_" + name;
}
void write(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}
std::vector<uint8_t> idx_images(uint32_t n, uint32_t r, uint32_t c) {
  std::vector<uint8_t> b = {0, 0, 8, 3};
  for (uint32_t v : {n, r, c})
    for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<uint8_t>(v >> s));
  for (uint32_t i = 0; i < n * r * c; ++i) b.push_back(static_cast<uint8_t>(i));
  return b;
}
std::vector<uint8_t> idx_labels(uint32_t n) {
  std::vector<uint8_t> b = {0, 0, 8, 1};
  for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<uint8_t>(n >> s));
  for (uint32_t i = 0; i < n; ++i) b.push_back(static_cast<uint8_t>(i % 10));
  return b;
}
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const IoError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Readers, IdxRoundTripRawAndGzip) {
  write(tmp("img"), idx_images(5, 3, 4));
  write(tmp("lab"), idx_labels(5));
  auto ds = load_idx(tmp("img"), tmp("lab"), "t");
  EXPECT_EQ(ds->size(), 5);
  EXPECT_EQ(ds->sample_shape(), Shape({3, 4, 1}));
  std::vector<float> x(12);
  EXPECT_EQ(ds->get(2, x.data()), 2);
  EXPECT_FLOAT_EQ(x[1], 25.f / 255.f);
  // gzip
  auto raw = idx_images(5, 3, 4);
  gzFile gz = gzopen(tmp("img.gz").c_str(), "wb");
  gzwrite(gz, raw.data(), static_cast<unsigned>(raw.size()));
  gzclose(gz);
  EXPECT_EQ(load_idx(tmp("img.gz"), tmp("lab"), "t")->size(), 5);
}

TEST(Readers, BadFilesNameTheFileAndTheProblem) {
  write(tmp("lab"), idx_labels(5));
  EXPECT_NE(error_of([] { load_idx(tmp("missing"), tmp("lab"), "t"); }).find("missing: cannot open"), std::string::npos);
  auto trunc = idx_images(5, 3, 4);
  trunc.resize(trunc.size() - 7);
  write(tmp("trunc"), trunc);
  std::string m = error_of([] { load_idx(tmp("trunc"), tmp("lab"), "t"); });
  EXPECT_NE(m.find("trunc"), std::string::npos);
  EXPECT_NE(m.find("truncated"), std::string::npos);
  write(tmp("magic"), {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17});
  EXPECT_NE(error_of([] { load_idx(tmp("magic"), tmp("lab"), "t"); }).find("not an IDX image file"), std::string::npos);
  write(tmp("img6"), idx_images(6, 3, 4));
  EXPECT_NE(error_of([] { load_idx(tmp("img6"), tmp("lab"), "t"); }).find("has 5 labels"), std::string::npos);
  write(tmp("bad.gz"), {0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 1, 2, 3});
  EXPECT_NE(error_of([] { read_file_maybe_gz(tmp("bad.gz")); }).find("gzip"), std::string::npos);
  std::filesystem::create_directories(tmp("cifar"));
  write(tmp("cifar") + "/test_batch.bin", std::vector<uint8_t>(3073 + 5, 1));
  EXPECT_NE(error_of([] { load_cifar10_dir(tmp("cifar"), "test"); }).find("not a whole number"), std::string::npos);
}

TEST(Readers, CraftedHeadersAndBombsAreNamedErrors) {
  // 2^32 - 1 images of 2^16 x 2^16 pixels: the 64-bit product wraps; must not be taken as 4 bytes.
  auto header = [](uint32_t n, uint32_t r, uint32_t c) {
    std::vector<uint8_t> b = {0, 0, 8, 3};
    for (uint32_t v : {n, r, c})
      for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<uint8_t>(v >> s));
    return b;
  };
  auto wrap = header(0xFFFFFFFFu, 0x10000u, 0x10000u);
  wrap.resize(wrap.size() + 4, 1);
  EXPECT_NE(error_of([&] { parse_idx_images(wrap, "wrap"); }).find("wrap: truncated or oversized"), std::string::npos);
  auto zero = header(3, 0, 5);
  EXPECT_NE(error_of([&] { parse_idx_images(zero, "zero"); }).find("zero:"), std::string::npos) << "0-pixel images";
  std::vector<uint8_t> lab = {0, 0, 8, 1, 0xFF, 0xFF, 0xFF, 0xFF, 1, 2};
  EXPECT_NE(error_of([&] { parse_idx_labels(lab, "lab"); }).find("lab: truncated"), std::string::npos);
  // A gzip stream that inflates past the limit.
  std::vector<uint8_t> big(1 << 20, 0);
  gzFile gz = gzopen(tmp("bomb.gz").c_str(), "wb9");
  gzwrite(gz, big.data(), static_cast<unsigned>(big.size()));
  gzclose(gz);
  std::ifstream in(tmp("bomb.gz"), std::ios::binary);
  std::vector<uint8_t> bomb((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(error_of([&] { maybe_gunzip(bomb, "bomb.gz", 64 << 10); }).find("bomb.gz: inflates to more than"),
            std::string::npos);
  EXPECT_EQ(maybe_gunzip(bomb, "bomb.gz").size(), big.size()) << "under the default limit it inflates";
}

TEST(Readers, FashionMnistFromDebian) {
  const std::string dir = "/usr/share/datasets/fashion-mnist";
  if (!std::filesystem::exists(dir + "/t10k-images-idx3-ubyte.gz"))
    GTEST_SKIP() << "dataset-fashion-mnist is not installed (scripts/setup.sh installs it)";
  auto test = load_mnist_dir(dir, "test", "fashion-mnist");
  EXPECT_EQ(test->size(), 10000);
  EXPECT_EQ(test->sample_shape(), Shape({28, 28, 1}));
  EXPECT_EQ(test->classes(), 10);
  EXPECT_EQ(test->labels()[0], 9);  // the first test image is an ankle boot
}
