// The automatic augmentation policies of torchvision (AutoAugment's ImageNet policy, RandAugment,
// TrivialAugmentWide) and random erasing, on a training sample in the loader's threads. The ops
// work on 8-bit HWC pixels with torchvision's tensor arithmetic (uint8 in, uint8 out: truncating
// blends, rounding blur, nearest-neighbour affine with zero fill), so a policy's op at a given
// magnitude gives torchvision's pixels (tests/reference/make_augment_fixtures.py). Which ops, signs
// and magnitudes a sample gets is drawn from (seed, epoch, index) alone, like every other draw of
// the loader: runs are reproducible whatever the thread timing or replica count.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace replica::data {

enum class AugmentPolicy { none, randaugment, trivialaugment, autoaugment };
AugmentPolicy parse_augment_policy(const std::string& name);  // throws ConfigError naming the choices
std::string augment_policy_name(AugmentPolicy p);

struct PolicyOptions {
  AugmentPolicy policy = AugmentPolicy::none;
  int randaugment_ops = 2;         // RandAugment's N
  int randaugment_magnitude = 9;   // RandAugment's M, of 31 bins (0..30)
  double random_erase = 0;         // RandomErasing's probability (scale [0.02, 0.33], ratio [0.3, 3.3], value 0)
};

enum class AugOp {
  identity, shear_x, shear_y, translate_x, translate_y, rotate, brightness, color, contrast, sharpness, posterize,
  solarize, autocontrast, equalize, invert
};
const char* aug_op_name(AugOp op);

// An image of 8-bit pixels, HWC.
struct Image8 {
  int64_t H = 0, W = 0, C = 0;
  std::vector<uint8_t> px;
};

// One op at one magnitude, torchvision's _apply_op: shears and rotations in their units (shear
// factor, degrees), translations in pixels (truncated), enhancements as factor - 1, posterize's
// bits, solarize's threshold (0..255).
void apply_aug_op(Image8& img, AugOp op, float magnitude);

// The policy's draw for one sample (key: the loader's (seed, epoch, index) hash) on HWC floats in
// [0, 1]: converted to 8 bits (rounding), transformed, and back (v / 255). Nothing happens for
// AugmentPolicy::none.
void apply_policy(const PolicyOptions& o, uint64_t key, float* hwc, int64_t H, int64_t W, int64_t C);

// Random erasing on a normalised sample (torchvision's RandomErasing: value 0, after Normalize):
// with probability o.random_erase, one box of 2%..33% of the area and aspect 0.3..3.3 is zeroed.
void random_erase(const PolicyOptions& o, uint64_t key, float* hwc, int64_t H, int64_t W, int64_t C);

// The magnitude of `op` at bin `bin` in the policy's space (torchvision's _augmentation_space:
// 31 bins for RandAugment and TrivialAugmentWide, 10 for AutoAugment; H x W sizes the
// translations of RandAugment and AutoAugment).
float policy_magnitude(AugmentPolicy p, AugOp op, int bin, int64_t H, int64_t W);

// torch.linspace(start, end, steps)[i] in f32, as torchvision's magnitude bins are built.
float linspace_bin(float start, float end, int steps, int i);

}  // namespace replica::data
