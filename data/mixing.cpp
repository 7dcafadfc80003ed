// Mixup and cutmix in pairs, drawn from (seed, epoch, index) alone: see mixing.h.
#include "data/mixing.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/errors.h"
#include "data/keyed_random.h"

namespace replica::data {

namespace {
uint64_t mix64(uint64_t x) { return KeyedRandom::hash(x); }

// Gamma and Beta draws from a keyed stream (logs take 1 - u, in (0, 1]).
double normal(KeyedRandom& r) {  // Box-Muller; one of the pair is enough here
  const double u = 1.0 - r.uniform(0, 1), v = r.uniform(0, 1);
  return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
}
// Gamma(a, 1): Marsaglia and Tsang for a >= 1; a < 1 through Gamma(a + 1) U^(1/a).
double gamma(KeyedRandom& r, double a) {
  if (a < 1) return gamma(r, a + 1) * std::pow(1.0 - r.uniform(0, 1), 1.0 / a);
  const double d = a - 1.0 / 3.0, c = 1.0 / std::sqrt(9.0 * d);
  for (;;) {
    double x, v;
    do {
      x = normal(r);
      v = 1.0 + c * x;
    } while (v <= 0);
    v = v * v * v;
    const double u = 1.0 - r.uniform(0, 1);
    if (u < 1.0 - 0.0331 * x * x * x * x) return d * v;
    if (std::log(u) < 0.5 * x * x + d * (1.0 - v + std::log(v))) return d * v;
  }
}

int32_t quantize(double lambda) {
  return static_cast<int32_t>(std::lround(std::clamp(lambda, 0.0, 1.0) * kMixOne));
}
}  // namespace

double beta_symmetric(double a, uint64_t key) {
  KeyedRandom r(mix64(key));
  const double x = gamma(r, a), y = gamma(r, a);
  return x + y > 0 ? x / (x + y) : 0.5;
}

MixDraw draw_mix(const MixOptions& o, uint64_t seed, int64_t epoch, int64_t first_index, int64_t H, int64_t W) {
  MixDraw d;
  if (!o.enabled() || (o.off_epoch > 0 && epoch >= o.off_epoch)) return d;
  const uint64_t key = mix64(mix64(seed ^ 0x6d697875ull) ^ mix64(static_cast<uint64_t>(epoch) * 0x9e37ull) ^
                             static_cast<uint64_t>(first_index));
  KeyedRandom r(key);
  if (r.uniform(0, 1) >= o.prob) return d;
  const bool cutmix = o.cutmix_alpha > 0 && (o.mixup_alpha <= 0 || r.uniform(0, 1) < o.switch_prob);
  const double lambda = beta_symmetric(cutmix ? o.cutmix_alpha : o.mixup_alpha, mix64(key ^ 0xbe7aull));
  if (!cutmix) {
    d.kind = MixKind::mixup;
    d.weight_q = quantize(lambda);
    return d;
  }
  // timm's rand_bbox: a box of side sqrt(1 - lambda) times the image's, centred anywhere, clipped;
  // lambda then follows the box that is left (timm's correct_lam, torchvision's CutMix).
  const double cut = std::sqrt(1.0 - lambda);
  const int64_t ch = static_cast<int64_t>(H * cut), cw = static_cast<int64_t>(W * cut);
  const int64_t cy = r.integer(0, H - 1), cx = r.integer(0, W - 1);
  d.kind = MixKind::cutmix;
  d.y0 = std::clamp<int64_t>(cy - ch / 2, 0, H);
  d.y1 = std::clamp<int64_t>(cy + ch / 2, 0, H);
  d.x0 = std::clamp<int64_t>(cx - cw / 2, 0, W);
  d.x1 = std::clamp<int64_t>(cx + cw / 2, 0, W);
  d.weight_q = quantize(1.0 - static_cast<double>((d.y1 - d.y0) * (d.x1 - d.x0)) / static_cast<double>(H * W));
  return d;
}

void apply_mix(const MixDraw& d, float* a, float* b, int64_t H, int64_t W, int64_t C) {
  if (d.kind == MixKind::mixup) {
    const float l = d.lambda(), m = 1.f - l;  // both exact: l is a multiple of 2^-24
    for (int64_t i = 0, n = H * W * C; i < n; ++i) {
      const float x = a[i], y = b[i];
      a[i] = l * x + m * y;
      b[i] = l * y + m * x;
    }
  } else if (d.kind == MixKind::cutmix) {
    for (int64_t h = d.y0; h < d.y1; ++h)
      std::swap_ranges(a + (h * W + d.x0) * C, a + (h * W + d.x1) * C, b + (h * W + d.x0) * C);
  }
}

void mix_batch(const MixOptions& o, uint64_t seed, int64_t epoch, const int64_t* indices, int64_t n, int64_t H,
               int64_t W, int64_t C, float* images, int32_t* labels) {
  if (n % 2 != 0)
    throw ConfigError("data.mixup_alpha / data.cutmix_alpha: mixing pairs samples within a micro-batch, which has " +
                      std::to_string(n) + " (odd); use an even train.micro_batch");
  const int64_t per = H * W * C;
  for (int64_t k = 0; k < n; k += 2) {
    const MixDraw d = draw_mix(o, seed, epoch, indices[k], H, W);
    apply_mix(d, images + k * per, images + (k + 1) * per, H, W, C);
    labels[2 * k + 1] = labels[2 * (k + 1) + 1] = d.weight_q;
  }
}

}  // namespace replica::data
