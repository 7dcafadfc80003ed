// Direct NHWC convolution on the CPU: a register-blocked kernel (6 output pixels x 16 output
// channels in 12 AVX2 accumulators, ops/cpu/direct_kernels.h) that reads a zero-padded input
// image and block-packed filters, with no column matrix. It serves the narrow ResNet layers
// where im2col + GEMM loses to packing (16-64 channels), and stride-1 backward data as the forward convolution of the padded output
// gradient with the flipped filter; the weight gradient the same way, 6 filter taps x 16 output
// channels accumulated over the pixels. Chosen at run time: AVX2 and FMA present, K a multiple of 8.
#pragma once
#include <cstdint>

#include "ops/backend.h"

namespace replica::ops::direct {

// Whether this CPU runs the kernel (AVX2 + FMA, checked once at run time); REPLICA_DIRECT_CONV=0
// turns it off (the im2col path then serves every convolution).
bool available();
// Turns the kernels on or off for the whole process (tests and benchmarks compare both paths);
// returns whether they were available before.
bool set_enabled(bool on);

// The avx512 kernel copy's direct kernels in 512-bit registers instead of 256-bit ones (the same
// bits): REPLICA_DIRECT_ZMM=1, or set_zmm. Off by default (measured slower on a Zen 4 EPYC:
// ops/cpu/direct_kernels.cpp). set_zmm returns the previous setting.
bool zmm_enabled();
bool set_zmm(bool on);

// The forward convolution of one geometry, direct: output channels a multiple of 8.
bool serves_forward(const ConvGeom& g);
// Backward data as a forward convolution: stride 1, square filter, pad < R, input channels a
// multiple of 8.
bool serves_backward_data(const ConvGeom& g);

// Winograd F(2x2, 3x3) or F(4x4, 3x3) (ops/cpu/winograd_kernels.h) for all three passes of a
// layer: 3x3, stride 1, padding 1, input and output channels multiples of 8, C K within the range
// measured to win (16 x 16 to 256 x 256; direct_conv.cpp says where each tile won). On by default
// where the direct kernels run; REPLICA_WINOGRAD=0 (or set_winograd) leaves those layers to the direct
// kernels. Its sums differ from the direct kernel's in the last bits (a different order and the
// transforms' roundings), within the error bound tests/ops/test_conv_kernels.cpp holds every path to.
bool winograd_enabled();
bool set_winograd(bool on);
// The output tile m (2 or 4) Winograd computes this layer's three passes with, 0 when it does
// not serve them.
int winograd_tile(const ConvGeom& g);
// Forces m = 2 or 4 wherever Winograd serves (0: the measured choice; REPLICA_WINOGRAD_TILE=2|4
// at start-up); returns the previous setting. For tests and benchmarks.
int set_winograd_tile(int m);
bool serves_winograd(const ConvGeom& g);

// Backward filter: output channels a multiple of 8, and at most 64 channels in and out or at
// least 28 x 28 output pixels (where it was measured faster than the GEMM), any stride and padding.
bool serves_backward_filter(const ConvGeom& g);

// Filters, KRSC in, out in the kernels' layout: blocks of 16 output channels (the last 8 when
// K = 16 m + 8), each block's R x S x C taps contiguous. For backward data w'[r][s][k][c] =
// w[k][R-1-r][S-1-s][c] (flipped, channels swapped), so backward data is forward_image with
// C' = K, K' = C.
void pack_forward(const float* w_krsc, float* out, const ConvGeom& g);
void pack_backward_data(const float* w_krsc, float* out, const ConvGeom& g);

// A zero-padded image buffer (conv.cpp KernelImages): the border is cleared once, each image
// then fills the interior.
struct PaddedGeom {
  int64_t H, W, C, pad;
  int64_t Hp() const { return H + 2 * pad; }
  int64_t Wp() const { return W + 2 * pad; }
  int64_t floats() const { return Hp() * Wp() * C; }
};

// The kernels that use these (forward_image, backward_filter_image) are part of each CPU kernel
// copy: ops/cpu/direct_kernels.h.

}  // namespace replica::ops::direct
