// The ImageNet recipe's transforms on decoded images, as torchvision defines them:
// RandomResizedCrop (scale, ratio; ten tries, then a centre crop) + horizontal flip for training,
// Resize(shorter side) + CenterCrop for evaluation. Resampling is separable with a triangle
// filter widened by the downscale factor (PIL's antialiased bilinear, torchvision's default on
// PIL images). Randomness comes from a key (seed, epoch, index), so a sample is reproducible.
#pragma once
#include "data/keyed_random.h"
#include <cstdint>

#include "data/image_codec.h"

namespace replica::data {

// A region of an image in its full-size pixel coordinates.
struct CropBox {
  double x = 0, y = 0, w = 0, h = 0;
};


struct CropRecipe {
  double scale_lo = 0.08, scale_hi = 1.0;     // of the image's area
  double ratio_lo = 3.0 / 4, ratio_hi = 4.0 / 3;  // width / height
};

CropBox random_resized_crop(int width, int height, const CropRecipe& r, KeyedRandom& rng);
// The region that Resize(shorter side -> resize) then CenterCrop(size) keeps.
CropBox center_crop(int width, int height, int resize, int size);

// Resamples `box` (in full-size coordinates; the image may be a DCT-scaled decode) to
// out_w x out_h, mirrored when `flip`, as floats in [0, 1], HWC with 3 channels.
void resample(const RgbImage& img, const CropBox& box, int out_w, int out_h, bool flip, float* out);

}  // namespace replica::data
