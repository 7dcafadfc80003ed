// AutoAugment (ImageNet policy), RandAugment, TrivialAugmentWide and random erasing with
// torchvision's tensor arithmetic on 8-bit pixels: see augment_policies.h.
#include "data/augment_policies.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "core/errors.h"
#include "data/keyed_random.h"

namespace replica::data {

namespace {

uint8_t to_u8_trunc(float v) { return static_cast<uint8_t>(std::clamp(v, 0.f, 255.f)); }  // torch's .to(uint8) after clamp

// torchvision's _blend on uint8 with ratio 1 + m: (r x1 + (1 - r) x2).clamp(0, 255) in f32,
// truncated; r and 1 - r are Python doubles rounded to f32 as torch takes a scalar.
template <class Other>
void blend(Image8& img, float m, Other other) {
  const double ratio = 1.0 + static_cast<double>(m);
  const float r = static_cast<float>(ratio), s = static_cast<float>(1.0 - ratio);
  for (size_t i = 0; i < img.px.size(); ++i) {
    const float a = r * static_cast<float>(img.px[i]);
    const float b = s * other(i);
    img.px[i] = to_u8_trunc(a + b);
  }
}

// rgb_to_grayscale: (0.2989 r + 0.587 g + 0.114 b) in f32, truncated to uint8.
std::vector<uint8_t> grayscale(const Image8& img) {
  std::vector<uint8_t> g(static_cast<size_t>(img.H * img.W));
  for (size_t p = 0; p < g.size(); ++p) {
    const uint8_t* q = img.px.data() + p * 3;
    const float a = 0.2989f * q[0], b = 0.587f * q[1], c = 0.114f * q[2];
    g[p] = static_cast<uint8_t>(a + b + c);
  }
  return g;
}

// _get_inverse_affine_matrix (torchvision.transforms.functional) in double, as Python computes it.
std::array<double, 6> inverse_affine(double cx, double cy, double angle, double tx, double ty, double shear_x,
                                     double shear_y) {
  const double rot = angle * M_PI / 180.0, sx = shear_x * M_PI / 180.0, sy = shear_y * M_PI / 180.0;
  const double a = std::cos(rot - sy) / std::cos(sy);
  const double b = -std::cos(rot - sy) * std::tan(sx) / std::cos(sy) - std::sin(rot);
  const double c = std::sin(rot - sy) / std::cos(sy);
  const double d = -std::sin(rot - sy) * std::tan(sx) / std::cos(sy) + std::cos(rot);
  std::array<double, 6> m{d, -b, 0.0, -c, a, 0.0};
  m[2] += m[0] * (-cx - tx) + m[1] * (-cy - ty);
  m[5] += m[3] * (-cx - tx) + m[4] * (-cy - ty);
  m[2] += cx;
  m[5] += cy;
  return m;
}

// F_t.affine with NEAREST and zero fill: _gen_affine_grid in f32, then grid_sample (align_corners
// false: x = ((g + 1) W - 1) / 2, rounded half to even).
void affine_nearest(Image8& img, const std::array<double, 6>& md) {
  const int64_t H = img.H, W = img.W, C = img.C;
  float th[6];
  for (int i = 0; i < 6; ++i) th[i] = static_cast<float>(md[i]);
  const float sw = 0.5f * static_cast<float>(W), sh = 0.5f * static_cast<float>(H);
  // rescaled_theta = theta^T / [0.5 w, 0.5 h]: rows (x, y, 1), columns (gx, gy)
  const float r00 = th[0] / sw, r10 = th[1] / sw, r20 = th[2] / sw;
  const float r01 = th[3] / sh, r11 = th[4] / sh, r21 = th[5] / sh;
  std::vector<uint8_t> out(img.px.size(), 0);
  for (int64_t y = 0; y < H; ++y) {
    const float by = linspace_bin(-static_cast<float>(H) * 0.5f + 0.5f, static_cast<float>(H) * 0.5f + 0.5f - 1.f,
                                  static_cast<int>(H), static_cast<int>(y));
    for (int64_t x = 0; x < W; ++x) {
      const float bx = linspace_bin(-static_cast<float>(W) * 0.5f + 0.5f, static_cast<float>(W) * 0.5f + 0.5f - 1.f,
                                    static_cast<int>(W), static_cast<int>(x));
      const float p0 = bx * r00, p1 = by * r10, gx = p0 + p1 + r20;
      const float q0 = bx * r01, q1 = by * r11, gy = q0 + q1 + r21;
      const float ix = ((gx + 1.f) * static_cast<float>(W) - 1.f) / 2.f;
      const float iy = ((gy + 1.f) * static_cast<float>(H) - 1.f) / 2.f;
      const float rx = std::nearbyint(ix), ry = std::nearbyint(iy);
      if (!(rx >= 0 && rx < static_cast<float>(W) && ry >= 0 && ry < static_cast<float>(H))) continue;
      const int64_t sx = static_cast<int64_t>(rx), sy = static_cast<int64_t>(ry);
      std::copy_n(img.px.data() + (sy * W + sx) * C, C, out.data() + (y * W + x) * C);
    }
  }
  img.px.swap(out);
}

void equalize_channel(Image8& img, int64_t c) {
  std::array<int64_t, 256> hist{};
  const int64_t C = img.C, n = img.H * img.W;
  for (int64_t p = 0; p < n; ++p) ++hist[img.px[p * C + c]];
  // step = (sum of the non-zero bins but the last) // 255
  int64_t last = -1, total = 0;
  for (int v = 0; v < 256; ++v)
    if (hist[v]) last = v;
  for (int v = 0; v < 256; ++v)
    if (hist[v] && v != last) total += hist[v];
  const int64_t step = total / 255;
  if (step == 0) return;
  std::array<uint8_t, 256> lut{};
  int64_t cum = 0;
  for (int v = 0; v < 256; ++v) {  // lut[v] = (cumsum[v - 1] + step // 2) // step, lut[0] = 0
    lut[v] = static_cast<uint8_t>(std::clamp<int64_t>(v == 0 ? 0 : (cum + step / 2) / step, 0, 255));
    cum += hist[v];
  }
  for (int64_t p = 0; p < n; ++p) img.px[p * C + c] = lut[img.px[p * C + c]];
}

// _blurred_degenerate_image: a 3x3 smoothing ([1 1 1; 1 5 1; 1 1 1] / 13, f32) rounded on the
// interior, the border kept.
std::vector<uint8_t> degenerate(const Image8& img) {
  const int64_t H = img.H, W = img.W, C = img.C;
  std::vector<uint8_t> out = img.px;
  const float k = 1.f / 13.f, kc = 5.f / 13.f;
  for (int64_t y = 1; y + 1 < H; ++y)
    for (int64_t x = 1; x + 1 < W; ++x)
      for (int64_t c = 0; c < C; ++c) {
        float s = 0;
        for (int dy = -1; dy <= 1; ++dy)
          for (int dx = -1; dx <= 1; ++dx) {
            const float w = (dy == 0 && dx == 0) ? kc : k;
            s += w * static_cast<float>(img.px[((y + dy) * W + x + dx) * C + c]);
          }
        out[(y * W + x) * C + c] = static_cast<uint8_t>(std::clamp(std::nearbyint(s), 0.f, 255.f));
      }
  return out;
}

// An op with its magnitude bins (torchvision's _augmentation_space) and whether its sign is drawn.
struct OpSpace {
  AugOp op;
  bool signed_;
  float lo, hi;  // linspace(lo, hi, bins); posterize: 8 - round(i / ((bins - 1) / (8 - hi)))
};

float magnitude_of(const OpSpace& s, int bins, int i) {
  if (s.op == AugOp::posterize)  // 8 - (arange(bins) / ((bins - 1) / k)).round().int(), k = 4 or 6
    return 8.f - std::nearbyint(static_cast<float>(i) / static_cast<float>((bins - 1) / static_cast<double>(s.hi)));
  if (s.lo == s.hi) return s.lo;
  return linspace_bin(s.lo, s.hi, bins, i);
}

// The 14 ops of RandAugment and TrivialAugmentWide, in torchvision's order.
std::array<OpSpace, 14> rand_space(bool wide, int64_t H, int64_t W) {
  const float shear = wide ? 0.99f : 0.3f, rot = wide ? 135.f : 30.f, enh = wide ? 0.99f : 0.9f;
  const float tx = wide ? 32.f : static_cast<float>(150.0 / 331.0 * static_cast<double>(W));
  const float ty = wide ? 32.f : static_cast<float>(150.0 / 331.0 * static_cast<double>(H));
  return {{{AugOp::identity, false, 0, 0},
           {AugOp::shear_x, true, 0, shear},
           {AugOp::shear_y, true, 0, shear},
           {AugOp::translate_x, true, 0, tx},
           {AugOp::translate_y, true, 0, ty},
           {AugOp::rotate, true, 0, rot},
           {AugOp::brightness, true, 0, enh},
           {AugOp::color, true, 0, enh},
           {AugOp::contrast, true, 0, enh},
           {AugOp::sharpness, true, 0, enh},
           {AugOp::posterize, false, 0, wide ? 6.f : 4.f},
           {AugOp::solarize, false, 255.f, 0.f},
           {AugOp::autocontrast, false, 0, 0},
           {AugOp::equalize, false, 0, 0}}};
}

// AutoAugment's ImageNet policy: 25 pairs of (op, probability, magnitude bin of 10; -1: none).
struct Step {
  AugOp op;
  float p;
  int bin;
};
constexpr Step kImageNet[25][2] = {
    {{AugOp::posterize, 0.4f, 8}, {AugOp::rotate, 0.6f, 9}},      {{AugOp::solarize, 0.6f, 5}, {AugOp::autocontrast, 0.6f, -1}},
    {{AugOp::equalize, 0.8f, -1}, {AugOp::equalize, 0.6f, -1}},   {{AugOp::posterize, 0.6f, 7}, {AugOp::posterize, 0.6f, 6}},
    {{AugOp::equalize, 0.4f, -1}, {AugOp::solarize, 0.2f, 4}},    {{AugOp::equalize, 0.4f, -1}, {AugOp::rotate, 0.8f, 8}},
    {{AugOp::solarize, 0.6f, 3}, {AugOp::equalize, 0.6f, -1}},    {{AugOp::posterize, 0.8f, 5}, {AugOp::equalize, 1.0f, -1}},
    {{AugOp::rotate, 0.2f, 3}, {AugOp::solarize, 0.6f, 8}},       {{AugOp::equalize, 0.6f, -1}, {AugOp::posterize, 0.4f, 6}},
    {{AugOp::rotate, 0.8f, 8}, {AugOp::color, 0.4f, 0}},          {{AugOp::rotate, 0.4f, 9}, {AugOp::equalize, 0.6f, -1}},
    {{AugOp::equalize, 0.0f, -1}, {AugOp::equalize, 0.8f, -1}},   {{AugOp::invert, 0.6f, -1}, {AugOp::equalize, 1.0f, -1}},
    {{AugOp::color, 0.6f, 4}, {AugOp::contrast, 1.0f, 8}},        {{AugOp::rotate, 0.8f, 8}, {AugOp::color, 1.0f, 2}},
    {{AugOp::color, 0.8f, 8}, {AugOp::solarize, 0.8f, 7}},        {{AugOp::sharpness, 0.4f, 7}, {AugOp::invert, 0.6f, -1}},
    {{AugOp::shear_x, 0.6f, 5}, {AugOp::equalize, 1.0f, -1}},     {{AugOp::color, 0.4f, 0}, {AugOp::equalize, 0.6f, -1}},
    {{AugOp::equalize, 0.4f, -1}, {AugOp::solarize, 0.2f, 4}},    {{AugOp::solarize, 0.6f, 5}, {AugOp::autocontrast, 0.6f, -1}},
    {{AugOp::invert, 0.6f, -1}, {AugOp::equalize, 1.0f, -1}},     {{AugOp::color, 0.6f, 4}, {AugOp::contrast, 1.0f, 8}},
    {{AugOp::equalize, 0.8f, -1}, {AugOp::equalize, 0.6f, -1}},
};

OpSpace auto_space(AugOp op, int64_t H, int64_t W) {  // AutoAugment's _augmentation_space(10)
  for (const auto& s : rand_space(false, H, W))
    if (s.op == op) return s;
  return {op, false, 0, 0};  // invert
}

}  // namespace

float linspace_bin(float start, float end, int steps, int i) {
  if (steps == 1) return start;
  const float step = (end - start) / static_cast<float>(steps - 1);
  return i < steps / 2 ? start + step * static_cast<float>(i) : end - step * static_cast<float>(steps - i - 1);
}

float policy_magnitude(AugmentPolicy p, AugOp op, int bin, int64_t H, int64_t W) {
  if (p == AugmentPolicy::autoaugment) return magnitude_of(auto_space(op, H, W), 10, bin);
  for (const auto& s : rand_space(p == AugmentPolicy::trivialaugment, H, W))
    if (s.op == op) return magnitude_of(s, 31, bin);
  throw ConfigError(std::string(aug_op_name(op)) + " is not an op of " + augment_policy_name(p));
}

AugmentPolicy parse_augment_policy(const std::string& name) {
  if (name == "none") return AugmentPolicy::none;
  if (name == "randaugment") return AugmentPolicy::randaugment;
  if (name == "trivialaugment") return AugmentPolicy::trivialaugment;
  if (name == "autoaugment") return AugmentPolicy::autoaugment;
  throw ConfigError("'" + name + "' is not an augmentation policy; use none, randaugment, trivialaugment or autoaugment");
}

std::string augment_policy_name(AugmentPolicy p) {
  switch (p) {
    case AugmentPolicy::randaugment: return "randaugment";
    case AugmentPolicy::trivialaugment: return "trivialaugment";
    case AugmentPolicy::autoaugment: return "autoaugment";
    default: return "none";
  }
}

const char* aug_op_name(AugOp op) {
  static const char* names[] = {"Identity", "ShearX",    "ShearY",    "TranslateX", "TranslateY",
                                "Rotate",   "Brightness", "Color",     "Contrast",   "Sharpness",
                                "Posterize", "Solarize", "AutoContrast", "Equalize", "Invert"};
  return names[static_cast<int>(op)];
}

void apply_aug_op(Image8& img, AugOp op, float magnitude) {
  const int64_t H = img.H, W = img.W, C = img.C;
  const double m = magnitude;
  switch (op) {
    case AugOp::identity:
      return;
    case AugOp::shear_x:  // F.affine(shear=[degrees(atan(m)), 0], center=[0, 0]): about the top-left corner
      affine_nearest(img, inverse_affine(-0.5 * W, -0.5 * H, 0, 0, 0, std::atan(m) * 180.0 / M_PI, 0));
      return;
    case AugOp::shear_y:
      affine_nearest(img, inverse_affine(-0.5 * W, -0.5 * H, 0, 0, 0, 0, std::atan(m) * 180.0 / M_PI));
      return;
    case AugOp::translate_x:
      affine_nearest(img, inverse_affine(0, 0, 0, static_cast<double>(static_cast<int>(magnitude)), 0, 0, 0));
      return;
    case AugOp::translate_y:
      affine_nearest(img, inverse_affine(0, 0, 0, 0, static_cast<double>(static_cast<int>(magnitude)), 0, 0));
      return;
    case AugOp::rotate:  // F.rotate passes -angle to the matrix
      affine_nearest(img, inverse_affine(0, 0, -m, 0, 0, 0, 0));
      return;
    case AugOp::brightness:
      blend(img, magnitude, [](size_t) { return 0.f; });
      return;
    case AugOp::color: {
      if (C != 3) return;  // torchvision leaves one-channel images as they are
      const auto g = grayscale(img);
      blend(img, magnitude, [&](size_t i) { return static_cast<float>(g[i / 3]); });
      return;
    }
    case AugOp::contrast: {
      double sum = 0;
      if (C == 3) {
        for (uint8_t v : grayscale(img)) sum += v;
      } else {
        for (uint8_t v : img.px) sum += v;
      }
      const float mean = static_cast<float>(sum / static_cast<double>(C == 3 ? H * W : H * W * C));
      blend(img, magnitude, [&](size_t) { return mean; });
      return;
    }
    case AugOp::sharpness: {
      if (H <= 2 || W <= 2) return;
      const auto d = degenerate(img);
      blend(img, magnitude, [&](size_t i) { return static_cast<float>(d[i]); });
      return;
    }
    case AugOp::posterize: {
      const int bits = static_cast<int>(magnitude);
      const uint8_t mask = static_cast<uint8_t>(-(1 << (8 - bits)));
      for (auto& v : img.px) v &= mask;
      return;
    }
    case AugOp::solarize:
      for (auto& v : img.px)
        if (static_cast<float>(v) >= magnitude) v = static_cast<uint8_t>(255 - v);
      return;
    case AugOp::autocontrast:
      for (int64_t c = 0; c < C; ++c) {
        uint8_t lo = 255, hi = 0;
        for (int64_t p = 0; p < H * W; ++p) {
          lo = std::min(lo, img.px[p * C + c]);
          hi = std::max(hi, img.px[p * C + c]);
        }
        float mn = lo, scale = 255.f / static_cast<float>(hi - lo);
        if (hi == lo) mn = 0, scale = 1;
        for (int64_t p = 0; p < H * W; ++p) {
          const float d = static_cast<float>(img.px[p * C + c]) - mn;
          img.px[p * C + c] = to_u8_trunc(d * scale);
        }
      }
      return;
    case AugOp::equalize:
      for (int64_t c = 0; c < C; ++c) equalize_channel(img, c);
      return;
    case AugOp::invert:
      for (auto& v : img.px) v = static_cast<uint8_t>(255 - v);
      return;
  }
}

void apply_policy(const PolicyOptions& o, uint64_t key, float* hwc, int64_t H, int64_t W, int64_t C) {
  if (o.policy == AugmentPolicy::none) return;
  Image8 img{H, W, C, std::vector<uint8_t>(static_cast<size_t>(H * W * C))};
  for (size_t i = 0; i < img.px.size(); ++i)
    img.px[i] = static_cast<uint8_t>(std::clamp(std::nearbyint(hwc[i] * 255.f), 0.f, 255.f));
  KeyedRandom r(KeyedRandom::hash(key ^ 0x6175676dull));
  auto below = [&](int n) { return static_cast<int>(r.integer(0, n - 1)); };
  auto signed_mag = [&](const OpSpace& s, float mag) { return s.signed_ && below(2) ? -mag : mag; };
  if (o.policy == AugmentPolicy::randaugment || o.policy == AugmentPolicy::trivialaugment) {
    const bool wide = o.policy == AugmentPolicy::trivialaugment;
    const auto space = rand_space(wide, H, W);
    const int rounds = wide ? 1 : o.randaugment_ops;
    for (int k = 0; k < rounds; ++k) {
      const OpSpace& s = space[below(static_cast<int>(space.size()))];
      const int bin = wide ? below(31) : o.randaugment_magnitude;
      apply_aug_op(img, s.op, signed_mag(s, magnitude_of(s, 31, bin)));
    }
  } else {  // autoaugment, ImageNet policy
    const auto& pair = kImageNet[below(25)];
    const double p0 = r.uniform(0, 1), p1 = r.uniform(0, 1);
    for (int k = 0; k < 2; ++k) {
      if ((k == 0 ? p0 : p1) > pair[k].p) continue;
      const OpSpace s = auto_space(pair[k].op, H, W);
      apply_aug_op(img, s.op, pair[k].bin < 0 ? 0.f : signed_mag(s, magnitude_of(s, 10, pair[k].bin)));
    }
  }
  for (size_t i = 0; i < img.px.size(); ++i) hwc[i] = static_cast<float>(img.px[i]) / 255.f;
}

void random_erase(const PolicyOptions& o, uint64_t key, float* hwc, int64_t H, int64_t W, int64_t C) {
  if (o.random_erase <= 0) return;
  KeyedRandom r(KeyedRandom::hash(key ^ 0x657261736500ull));
  if (r.uniform(0, 1) >= o.random_erase) return;
  const double area = static_cast<double>(H * W), lr0 = std::log(0.3), lr1 = std::log(3.3);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double erase = area * r.uniform(0.02, 0.33);
    const double aspect = std::exp(r.uniform(lr0, lr1));
    const int64_t h = std::llround(std::sqrt(erase * aspect)), w = std::llround(std::sqrt(erase / aspect));
    if (!(h < H && w < W)) continue;
    const int64_t y0 = r.integer(0, H - h), x0 = r.integer(0, W - w);
    for (int64_t y = y0; y < y0 + h; ++y) std::fill(hwc + (y * W + x0) * C, hwc + (y * W + x0 + w) * C, 0.f);
    return;
  }
}

}  // namespace replica::data
