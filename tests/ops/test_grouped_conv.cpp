// Grouped convolution (ConvGeom::groups, ResNeXt's 3x3 layers) against PyTorch
// (tests/reference/make_grouped_conv_fixtures.py, tests/fixtures/grouped_conv_golden.bin):
// forward, input gradient and weight gradient (accumulating) for group counts 2 to 32, strides 1
// and 2, 1x1 and 3x3, 1 to 4 channels per group, in f32 and in the 16-bit storage types; the
// Conv2d layer's filter shape and errors. The CUDA backend is held to the CPU one in the
// conformance suite (BackendConformance.GroupedConvolution).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/errors.h"
#include "core/pools.h"
#include "core/tensor.h"
#include "ops/backend.h"
#include "ops/nn/layer.h"
#include "ops/nn/params.h"
#include "support/compare.h"
#include "support/fixture.h"

using namespace replica;

namespace {

const auto& fixture() {
  static const auto f =
      replica::testing::load_fixture(std::string(REPLICA_SOURCE_DIR) + "/tests/fixtures/grouped_conv_golden.bin");
  return f;
}

struct Case {
  const char* name;
  int64_t N, H, W, C, K, R, stride, pad, groups;
};
// make_grouped_conv_fixtures.py's CASES
const Case kCases[] = {{"g4_s1", 2, 7, 6, 8, 12, 3, 1, 1, 4},          {"g8_s2", 2, 9, 9, 16, 16, 3, 2, 1, 8},
                       {"g2_c3", 1, 5, 7, 6, 6, 3, 1, 1, 2},           {"g16_c4_s2", 2, 6, 6, 64, 64, 3, 2, 1, 16},
                       {"g32_depthwise", 2, 5, 5, 32, 32, 3, 1, 1, 32}, {"g2_1x1", 2, 5, 5, 8, 16, 1, 1, 0, 2}};

Tensor put(MemoryPool& pool, const replica::testing::FixtureTensor& f, DType dt) {
  Shape s = {f.shape[0], f.shape[1], f.shape[2], f.shape[3]};  // every tensor here is 4-D
  Tensor t = Tensor::empty(pool, s, dt, MemTag::other);
  convert(f.data.data(), DType::f32, t.raw(), dt, f.data.size());
  return t;
}

std::vector<float> get(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  convert(t.raw(), t.dtype(), v.data(), DType::f32, v.size());
  return v;
}

}  // namespace

TEST(GroupedConv, MatchesPyTorchForwardAndBothGradients) {
  auto pool = make_pool(Device{DeviceKind::cpu, 0}, PoolOptions{});
  auto& be = ops::backend_for(Device{DeviceKind::cpu, 0});
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    const double tol = dt == DType::f32 ? 2e-6 : dt == DType::f16 ? 4e-3 : 3e-2;
    for (const Case& c : kCases) {
      const auto& f = fixture();
      const std::string n = c.name;
      const auto g = ops::ConvGeom::make({c.N, c.H, c.W, c.C}, c.K, c.R, c.R, c.stride, c.pad, n, c.groups);
      Tensor x = put(*pool, f.at(n + "_x"), dt), w = put(*pool, f.at(n + "_w"), dt), dy = put(*pool, f.at(n + "_dy"), dt);
      Tensor y = Tensor::empty(*pool, {g.N, g.P, g.Q, g.K}, dt, MemTag::other);
      be.conv2d_forward(x, w, y, g, *pool);
      EXPECT_LE(replica::testing::max_rel_diff(get(y), f.at(n + "_y").data), tol) << n << " forward " << dtype_name(dt);
      Tensor dx = Tensor::empty(*pool, x.shape(), dt, MemTag::other);
      be.conv2d_backward_data(dy, w, dx, g, *pool, false);
      EXPECT_LE(replica::testing::max_rel_diff(get(dx), f.at(n + "_dx").data), tol) << n << " dx " << dtype_name(dt);
      // The weight gradient accumulates: start from 1 and subtract it.
      Tensor dw = Tensor::empty(*pool, w.shape(), DType::f32, MemTag::other);
      be.fill(dw, 1.f);
      be.conv2d_backward_filter(x, dy, dw, g, *pool);
      std::vector<float> got = get(dw);
      for (float& v : got) v -= 1.f;
      EXPECT_LE(replica::testing::max_rel_diff(got, f.at(n + "_dw").data), dt == DType::f32 ? 1e-5 : tol)
          << n << " dw " << dtype_name(dt);
    }
  }
}

// The layer: a grouped Conv2d keeps [K, k, k, C / groups] filters (torchvision's weight, KRSC
// here) with fan-in C / groups x k x k; groups that do not divide the channels are named errors.
TEST(GroupedConv, LayerShapesAndErrors) {
  nn::Conv2d conv("layer1.0.conv2", 128, 128, 3, 1, 1, 32);
  nn::ParamRegistry reg;
  conv.register_params(reg);
  ASSERT_EQ(reg.params().size(), 1u);
  EXPECT_EQ(reg.params()[0].shape, (Shape{128, 3, 3, 4}));
  EXPECT_EQ(reg.params()[0].fan_in, 4 * 9);
  EXPECT_EQ(conv.output_shape({2, 8, 8, 128}), (Shape{2, 8, 8, 128}));
  EXPECT_THROW(nn::Conv2d("bad", 128, 128, 3, 1, 1, 48), ShapeError);
  EXPECT_THROW(ops::ConvGeom::make({1, 4, 4, 6}, 8, 3, 3, 1, 1, "bad", 4), ShapeError);
}
