// Mixup and cutmix in pairs (timm's "pair" mode): samples 2k and 2k+1 of a micro-batch are mixed
// with each other, with one lambda (and one cutmix box) per pair drawn from (seed, epoch, the
// dataset index of sample 2k) alone. A pair never straddles two replicas or micro-batches (an even
// micro-batch keeps both halves together), so a run mixes the same images whatever its replica
// count, accumulation or resume point.
//
// The targets travel with the labels: a mixing run's labels are i32 [n, 2], column 0 the label and
// column 1 the weight of the row's own label in units of 2^-24 (kMixOne = 1); the rest of the
// target goes to the label of its partner, row n ^ 1 (ops/backend.h, softmax_xent_*).
#pragma once
#include <cstdint>
#include <string>

namespace replica::data {

constexpr int32_t kMixOne = 1 << 24;  // a label weight of 1 (exact in f32: weights are q * 2^-24)

struct MixOptions {
  double mixup_alpha = 0;       // lambda ~ Beta(a, a) for mixup; 0: no mixup
  double cutmix_alpha = 0;      // lambda ~ Beta(a, a) for cutmix's box; 0: no cutmix
  double prob = 1;              // the chance that a pair is mixed at all (timm's mix prob)
  double switch_prob = 0.5;     // with both on, the chance of cutmix rather than mixup
  int64_t off_epoch = 0;        // epochs from this one on are not mixed (0: never stops)
  bool enabled() const { return mixup_alpha > 0 || cutmix_alpha > 0; }
};

enum class MixKind { none, mixup, cutmix };

// One pair's draw: the weight of each sample's own image and label (lambda, after cutmix's
// correction for the clipped box: 1 - box area / image area) and cutmix's box [y0, y1) x [x0, x1).
struct MixDraw {
  MixKind kind = MixKind::none;
  int32_t weight_q = kMixOne;  // lambda in units of 2^-24
  int64_t y0 = 0, y1 = 0, x0 = 0, x1 = 0;
  float lambda() const { return static_cast<float>(weight_q) * (1.f / static_cast<float>(kMixOne)); }
};

// The draw of the pair whose first sample is dataset index `first_index` in `epoch`.
MixDraw draw_mix(const MixOptions& o, uint64_t seed, int64_t epoch, int64_t first_index, int64_t H, int64_t W);

// Mixes one pair in place (HWC f32 images of H x W x C): mixup a' = l a + (1 - l) b and
// b' = l b + (1 - l) a; cutmix pastes the box of b into a and of a into b.
void apply_mix(const MixDraw& d, float* a, float* b, int64_t H, int64_t W, int64_t C);

// Mixes a micro-batch of n samples (n even) in place: images [n, H, W, C], `indices` the samples'
// dataset indices, `labels` [n, 2] with column 0 filled; writes column 1.
void mix_batch(const MixOptions& o, uint64_t seed, int64_t epoch, const int64_t* indices, int64_t n, int64_t H,
               int64_t W, int64_t C, float* images, int32_t* labels);

// Beta(a, a) from uniform draws (Marsaglia and Tsang's gamma): a pure function of `key`.
double beta_symmetric(double a, uint64_t key);

}  // namespace replica::data
