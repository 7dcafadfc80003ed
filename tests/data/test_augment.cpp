// The augmentation policies against torchvision (tests/reference/make_augment_fixtures.py,
// tests/fixtures/augment_golden.bin): every op of AutoAugment, RandAugment and TrivialAugmentWide
// at several magnitudes on a 3-channel and a 1-channel uint8 image, and the policies' magnitude
// bins; then the draws: a pure function of the key, and random erasing's box and probability.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "core/errors.h"
#include "data/augment_policies.h"
#include "data/loader.h"
#include "support/fixture.h"

using namespace replica;
using namespace replica::data;

namespace {

const auto& fixture() {
  static const auto f = replica::testing::load_fixture(std::string(REPLICA_SOURCE_DIR) + "/tests/fixtures/augment_golden.bin");
  return f;
}

Image8 image(const std::string& tag) {
  const auto& t = fixture().at("img_" + tag);
  Image8 img{t.shape[0], t.shape[1], t.shape[2], {}};
  for (float v : t.data) img.px.push_back(static_cast<uint8_t>(v));
  return img;
}

struct OpCase {
  AugOp op;
  std::vector<float> mags;
};
// make_augment_fixtures.py's OPS, in its order.
const std::vector<OpCase> kOps = {
    {AugOp::shear_x, {0.3f, -0.17f, 0.99f}}, {AugOp::shear_y, {0.21f, -0.3f}},   {AugOp::translate_x, {5.f, -13.6f}},
    {AugOp::translate_y, {3.f, -7.9f}},      {AugOp::rotate, {30.f, -13.f, 135.f}}, {AugOp::brightness, {0.9f, -0.5f}},
    {AugOp::color, {0.9f, -0.66f}},          {AugOp::contrast, {0.8f, -0.42f}},  {AugOp::sharpness, {0.9f, -0.9f}},
    {AugOp::posterize, {4.f, 7.f, 2.f}},     {AugOp::solarize, {128.f, 30.f}},   {AugOp::autocontrast, {0.f}},
    {AugOp::equalize, {0.f}},                {AugOp::invert, {0.f}},
};

bool geometric(AugOp op) { return op <= AugOp::rotate; }

}  // namespace

// Each op's pixels: the integer ops exactly; the blends and autocontrast within 1 on at most 1% of
// the values (torch's vector kernels may contract a product and a sum); the nearest-neighbour geometry on at most 2% of the pixels (a source
// coordinate that lands on .5 may round either way after torch's f32 matrix product).
TEST(Augment, EveryOpMatchesTorchvision) {
  int64_t geo_differ = 0;
  for (const char* tag : {"c3", "c1"}) {
    for (const auto& c : kOps)
      for (size_t k = 0; k < c.mags.size(); ++k) {
        Image8 img = image(tag);
        apply_aug_op(img, c.op, c.mags[k]);
        const auto& want = fixture().at(std::string(aug_op_name(c.op)) + "_" + std::to_string(k) + "_" + tag).data;
        ASSERT_EQ(want.size(), img.px.size());
        int64_t differ = 0, worst = 0;
        for (size_t i = 0; i < want.size(); ++i) {
          const int64_t d = std::llabs(static_cast<int64_t>(img.px[i]) - static_cast<int64_t>(want[i]));
          differ += d != 0;
          worst = std::max(worst, d);
        }
        const std::string what = std::string(aug_op_name(c.op)) + " " + std::to_string(c.mags[k]) + " " + tag;
        const double frac = static_cast<double>(differ) / static_cast<double>(want.size());
        if (geometric(c.op)) {
          EXPECT_LE(frac, 0.02) << what << ": " << differ << " values differ";
          geo_differ += differ;
        } else if (c.op == AugOp::posterize || c.op == AugOp::solarize || c.op == AugOp::equalize || c.op == AugOp::invert) {
          EXPECT_EQ(differ, 0) << what << " (worst " << worst << ")";
        } else {
          EXPECT_LE(worst, 1) << what;
          EXPECT_LE(frac, 0.01) << what << ": " << differ << " values differ";
        }
      }
  }
  std::printf("geometric ops: %ld values differ from torchvision's in all cases\n", static_cast<long>(geo_differ));
}

// The magnitude bins: torch.linspace in f32 and posterize's rounded bits, as each policy builds them.
TEST(Augment, MagnitudeBinsAreTorchvisions) {
  const std::map<std::string, AugOp> ops = {
      {"ShearX", AugOp::shear_x},     {"ShearY", AugOp::shear_y},       {"TranslateX", AugOp::translate_x},
      {"TranslateY", AugOp::translate_y}, {"Rotate", AugOp::rotate},    {"Brightness", AugOp::brightness},
      {"Color", AugOp::color},        {"Contrast", AugOp::contrast},    {"Sharpness", AugOp::sharpness},
      {"Posterize", AugOp::posterize}, {"Solarize", AugOp::solarize}};
  int checked = 0;
  for (const auto& [prefix, policy] : std::map<std::string, AugmentPolicy>{
           {"ra", AugmentPolicy::randaugment}, {"aa", AugmentPolicy::autoaugment}, {"ta", AugmentPolicy::trivialaugment}})
    for (const auto& [name, op] : ops) {
      const auto& bins = fixture().at("bins_" + prefix + "_" + name).data;
      for (size_t i = 0; i < bins.size(); ++i, ++checked)  // torch's vectorised linspace may differ in the last bit
        EXPECT_NEAR(policy_magnitude(policy, op, static_cast<int>(i), 23, 29), bins[i], 1e-6 * (1 + std::abs(bins[i])))
            << prefix << " " << name << " bin " << i;
    }
  EXPECT_EQ(checked, 11 * (31 + 10 + 31));
}

// A policy's draw depends on its key alone; none leaves the image; every policy changes some images.
TEST(Augment, PoliciesArePureFunctionsOfTheKey) {
  const Image8 src = image("c3");
  std::vector<float> f(src.px.size());
  for (size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>(src.px[i]) / 255.f;
  for (auto p : {AugmentPolicy::randaugment, AugmentPolicy::trivialaugment, AugmentPolicy::autoaugment}) {
    PolicyOptions o{.policy = p};
    int changed = 0;
    for (uint64_t key = 0; key < 40; ++key) {
      auto a = f, b = f;
      apply_policy(o, key, a.data(), src.H, src.W, src.C);
      apply_policy(o, key, b.data(), src.H, src.W, src.C);
      ASSERT_EQ(a, b) << augment_policy_name(p) << " key " << key;
      changed += a != f;
      for (float v : a) ASSERT_TRUE(v >= 0.f && v <= 1.f);
    }
    EXPECT_GT(changed, 20) << augment_policy_name(p) << " changes most images";
  }
  auto a = f;
  apply_policy(PolicyOptions{}, 3, a.data(), src.H, src.W, src.C);
  EXPECT_EQ(a, f) << "none";
  EXPECT_THROW(parse_augment_policy("rand-m9"), ConfigError);
}

// Random erasing: with probability p one box of 2%..33% of the area, zeroed (the normalised mean).
TEST(Augment, RandomErasingZeroesOneBoxWithItsProbability) {
  const int64_t H = 32, W = 24, C = 3;
  PolicyOptions o{.random_erase = 0.5};
  int erased = 0;
  for (uint64_t key = 0; key < 2000; ++key) {
    std::vector<float> x(H * W * C, 1.f);
    random_erase(o, key, x.data(), H, W, C);
    int64_t zeros = 0;
    for (float v : x) zeros += v == 0.f;
    if (!zeros) continue;
    ++erased;
    ASSERT_EQ(zeros % C, 0);
    const double area = static_cast<double>(zeros / C) / (H * W);
    EXPECT_GE(area, 0.015);
    EXPECT_LE(area, 0.36);
  }
  // torchvision's 10 tries at a box that fits can all fail (area x aspect may exceed the image):
  // a little under p.
  EXPECT_GT(erased / 2000.0, 0.42);
  EXPECT_LT(erased / 2000.0, 0.52);
}

// The loader applies the policy to training samples (not to evaluation's), from (seed, epoch, index):
// the same call gives the same pixels, another epoch other ones.
TEST(Augment, TheLoaderAppliesThePolicyToTrainingSamplesOnly) {
  SyntheticDataset ds(Shape{16, 12, 3}, 4, 32, 5);
  AugmentOptions plain{0, false, {}, {}}, policy = plain;
  policy.policy.policy = AugmentPolicy::trivialaugment;
  const std::vector<int64_t> idx{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  const size_t n = idx.size() * 16 * 12 * 3;
  std::vector<float> a(n), b(n), c(n), d(n), e(n);
  std::vector<int32_t> lab(idx.size());
  load_samples(ds, idx, plain, true, 7, 0, a.data(), lab.data());
  load_samples(ds, idx, policy, true, 7, 0, b.data(), lab.data());
  load_samples(ds, idx, policy, true, 7, 0, c.data(), lab.data());
  load_samples(ds, idx, policy, true, 7, 1, d.data(), lab.data());
  load_samples(ds, idx, policy, false, 7, 0, e.data(), lab.data());
  EXPECT_NE(a, b) << "the policy changes training samples";
  EXPECT_EQ(b, c) << "from (seed, epoch, index) alone";
  EXPECT_NE(b, d) << "another epoch draws again";
  EXPECT_EQ(a, e) << "evaluation is not augmented";
}
