// Crop geometry (torchvision's) and antialiased separable resampling.
#include "data/image_transforms.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace replica::data {

CropBox random_resized_crop(int W, int H, const CropRecipe& r, KeyedRandom& rng) {
  const double area = static_cast<double>(W) * H;
  const double log_lo = std::log(r.ratio_lo), log_hi = std::log(r.ratio_hi);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * rng.uniform(r.scale_lo, r.scale_hi);
    const double aspect = std::exp(rng.uniform(log_lo, log_hi));
    const int w = static_cast<int>(std::lround(std::sqrt(target * aspect)));
    const int h = static_cast<int>(std::lround(std::sqrt(target / aspect)));
    if (w > 0 && w <= W && h > 0 && h <= H) {
      const int64_t y = rng.integer(0, H - h), x = rng.integer(0, W - w);
      return {static_cast<double>(x), static_cast<double>(y), static_cast<double>(w), static_cast<double>(h)};
    }
  }
  // torchvision's fallback: the whole image, cut to the nearest allowed aspect ratio, centred.
  const double in_ratio = static_cast<double>(W) / H;
  double w = W, h = H;
  if (in_ratio < r.ratio_lo) h = std::lround(w / r.ratio_lo);
  else if (in_ratio > r.ratio_hi) w = std::lround(h * r.ratio_hi);
  return {std::floor((W - w) / 2), std::floor((H - h) / 2), w, h};
}

CropBox center_crop(int W, int H, int resize, int size) {
  const double s = static_cast<double>(resize) / std::min(W, H);  // the resize's scale
  const double cw = std::min<double>(W, size / s), ch = std::min<double>(H, size / s);
  return {(W - cw) / 2, (H - ch) / 2, cw, ch};
}

namespace {
// For each output position: the first source index and the normalised weights of its taps.
struct Taps {
  std::vector<int> first;
  std::vector<int> count;
  std::vector<float> weights;  // count[i] per output, packed at offset[i]
  std::vector<size_t> offset;
};

Taps taps(double start, double length, int src_size, int out_size) {
  Taps t;
  const double scale = length / out_size;
  const double support = std::max(1.0, scale);  // the triangle widens when downscaling (antialias)
  for (int o = 0; o < out_size; ++o) {
    const double centre = start + (o + 0.5) * scale;
    int lo = static_cast<int>(std::floor(centre - support)), hi = static_cast<int>(std::ceil(centre + support));
    lo = std::max(lo, 0);
    hi = std::min(hi, src_size - 1);
    t.first.push_back(lo);
    t.offset.push_back(t.weights.size());
    double sum = 0;
    const size_t at = t.weights.size();
    for (int i = lo; i <= hi; ++i) {
      const double w = std::max(0.0, 1.0 - std::fabs(i + 0.5 - centre) / support);
      t.weights.push_back(static_cast<float>(w));
      sum += w;
    }
    if (sum <= 0) {  // a box beyond the image edge: nearest pixel
      t.weights.resize(at);
      t.first.back() = std::clamp(static_cast<int>(centre), 0, src_size - 1);
      t.weights.push_back(1.f);
      sum = 1;
    }
    for (size_t k = at; k < t.weights.size(); ++k) t.weights[k] = static_cast<float>(t.weights[k] / sum);
    t.count.push_back(static_cast<int>(t.weights.size() - at));
  }
  return t;
}
}  // namespace

void resample(const RgbImage& img, const CropBox& box, int out_w, int out_h, bool flip, float* out) {
  // From full-size coordinates to the decoded image's (a DCT-scaled decode is smaller).
  const double fx = img.full_width ? static_cast<double>(img.width) / img.full_width : 1.0;
  const double fy = img.full_height ? static_cast<double>(img.height) / img.full_height : 1.0;
  const Taps tx = taps(box.x * fx, box.w * fx, img.width, out_w);
  const Taps ty = taps(box.y * fy, box.h * fy, img.height, out_h);
  // Rows the vertical taps touch, resampled horizontally once each.
  const int row_lo = ty.first.front();
  int row_hi = row_lo;
  for (int o = 0; o < out_h; ++o) row_hi = std::max(row_hi, ty.first[o] + ty.count[o] - 1);
  std::vector<float> rows(static_cast<size_t>(row_hi - row_lo + 1) * out_w * 3);
  constexpr float inv255 = 1.0f / 255.0f;
  for (int y = row_lo; y <= row_hi; ++y) {
    const uint8_t* src = img.pixels.data() + static_cast<size_t>(y) * img.width * 3;
    float* dst = rows.data() + static_cast<size_t>(y - row_lo) * out_w * 3;
    for (int o = 0; o < out_w; ++o) {
      float r = 0, g = 0, b = 0;
      const float* w = tx.weights.data() + tx.offset[o];
      for (int k = 0; k < tx.count[o]; ++k) {
        const uint8_t* p = src + static_cast<size_t>(tx.first[o] + k) * 3;
        r += w[k] * p[0];
        g += w[k] * p[1];
        b += w[k] * p[2];
      }
      const int at = flip ? out_w - 1 - o : o;
      dst[3 * at] = r * inv255;
      dst[3 * at + 1] = g * inv255;
      dst[3 * at + 2] = b * inv255;
    }
  }
  for (int o = 0; o < out_h; ++o) {
    float* dst = out + static_cast<size_t>(o) * out_w * 3;
    std::fill(dst, dst + static_cast<size_t>(out_w) * 3, 0.f);
    const float* w = ty.weights.data() + ty.offset[o];
    for (int k = 0; k < ty.count[o]; ++k) {
      const float* src = rows.data() + static_cast<size_t>(ty.first[o] + k - row_lo) * out_w * 3;
      for (int i = 0; i < out_w * 3; ++i) dst[i] += w[k] * src[i];
    }
  }
}

}  // namespace replica::data
