// Layers and models: shape errors name the layer, parameter counts match torchvision, activation
// memory is visible by tag and released by backward, gradients accumulate across passes.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "core/errors.h"
#include "ops/cpu/threads.h"
#include "ops/models/resnet.h"
#include "support/layer_harness.h"

using namespace replica;

namespace {
int64_t real_params(const nn::Model& m) {
  int64_t n = 0;
  for (auto& p : m.registry().params()) n += p.shape.numel();
  return n;
}
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ShapeError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Layers, ArgumentErrorsNameTheLayerAndShapes) {
  EXPECT_NE(error_of([] { nn::Conv2d("layer1.0.conv1", 3, 4, 3, 0, 1); }).find("layer1.0.conv1"), std::string::npos);
  nn::Conv2d conv("stem.conv", 3, 8, 3, 1, 1);
  std::string m = error_of([&] { conv.output_shape({2, 8, 8, 1}); });
  EXPECT_NE(m.find("stem.conv"), std::string::npos);
  EXPECT_NE(m.find("[2,8,8,1]"), std::string::npos);
  EXPECT_NE(m.find("3 input channels"), std::string::npos);
  EXPECT_NE(error_of([&] { conv.output_shape({0, 8, 8, 3}); }).find("empty batch"), std::string::npos);
  nn::Linear fc("fc", 10, 2);
  EXPECT_NE(error_of([&] { fc.output_shape({4, 9}); }).find("fc"), std::string::npos);
  EXPECT_EQ(conv.output_shape({2, 8, 8, 3}), Shape({2, 8, 8, 8}));
  EXPECT_THROW(models::make_resnet({.arch = "resnet21"}), ConfigError);
}

TEST(Models, ParameterCountsMatchReference) {
  // torchvision's counts (1000 classes, 3 channels)
  models::ResNetConfig in{.arch = "resnet50", .in_channels = 3, .num_classes = 1000, .height = 224, .width = 224};
  EXPECT_EQ(real_params(*models::make_resnet(in)), 25557032);
  in.arch = "resnet18";
  EXPECT_EQ(real_params(*models::make_resnet(in)), 11689512);
  in.arch = "resnet34";
  EXPECT_EQ(real_params(*models::make_resnet(in)), 21797672);
  // ../shared/anchors/torch_resnet.py's ResNet-20 (option-B shortcuts, 1 channel, 10 classes)
  auto r20 = models::make_resnet({});
  EXPECT_EQ(real_params(*r20), 272186);  // sum(p.numel()) of the anchor model
  EXPECT_EQ(r20->output_shape(5), Shape({5, 10}));
  EXPECT_EQ(models::make_resnet({.arch = "resnet56"})->registry().params().size(), 3u + 27 * 6 + 2 * 3 + 2);
}

TEST(Models, ActivationsVisibleByTagAndReleasedByBackward) {
  auto pool = replica::testing::test_pool();
  auto model = models::make_resnet({});
  model->materialize(*pool, 1);
  auto& acts = [&]() -> const TagStats& { static TagStats t; t = pool->stats().tags[static_cast<int>(MemTag::activations)]; return t; }();
  (void)acts;
  Tensor x = Tensor::zeros(*pool, {8, 28, 28, 1}, DType::f32, MemTag::activations);
  size_t base = pool->stats().tags[static_cast<int>(MemTag::activations)].in_use;
  nn::Context ctx(*pool, ops::backend_for(pool->device()), true);
  Tensor logits = model->forward(ctx, x);
  size_t after_fwd = pool->stats().tags[static_cast<int>(MemTag::activations)].in_use;
  // ResNet-20 at 28x28 saves well over 8 images x 16 ch x 784 px x 4 B x 10 tensors
  EXPECT_GT(after_fwd - base, size_t(8) * 16 * 784 * 4 * 10);
  Tensor d = Tensor::zeros(*pool, logits.shape(), DType::f32, MemTag::activations);
  model->backward(ctx, d);
  d = Tensor();
  logits = Tensor();
  EXPECT_EQ(ctx.saved_count(), 0u);
  EXPECT_EQ(pool->stats().tags[static_cast<int>(MemTag::activations)].in_use, base);
  EXPECT_GT(pool->stats().tags[static_cast<int>(MemTag::workspace)].peak_in_use, 0u);
  EXPECT_EQ(pool->stats().tags[static_cast<int>(MemTag::params)].in_use,
            pool->stats().tags[static_cast<int>(MemTag::grads)].in_use +
                (static_cast<size_t>(model->num_buffers()) * 4 + 255) / 256 * 256);
}

TEST(Models, GradientsAccumulateAcrossPasses) {
  auto pool = replica::testing::test_pool();
  models::ResNetConfig cfg{.arch = "resnet20", .height = 8, .width = 8, .base_width = 4};
  auto model = models::make_resnet(cfg);
  model->materialize(*pool, 1);
  Tensor x = Tensor::empty(*pool, {4, 8, 8, 1}, DType::f32, MemTag::activations);
  std::mt19937 rng(1);
  replica::testing::fill_random(x, rng);
  auto run = [&] {
    nn::Context ctx(*pool, ops::backend_for(pool->device()), true);
    Tensor y = model->forward(ctx, x);
    Tensor d = Tensor::empty(*pool, y.shape(), DType::f32, MemTag::activations);
    std::fill_n(d.data<float>(), d.numel(), 0.1f);
    model->backward(ctx, d);
  };
  model->zero_grad();
  run();
  std::vector<float> once(model->grads().data<float>(), model->grads().data<float>() + model->num_params());
  run();
  for (int64_t i = 0; i < model->num_params(); i += 97)
    EXPECT_NEAR(model->grads().data<float>()[i], 2 * once[i], 1e-5 + 1e-4 * std::abs(once[i]));
}

TEST(Threads, IntraOpThreadsGiveTheSameBits) {
  // Without OpenMP there is one thread only: comparing it with itself would prove nothing.
  if (!ops::intra_op_threads_supported()) GTEST_SKIP() << "built without OpenMP: one intra-op thread only";
  auto pool = replica::testing::test_pool();
  auto& be = ops::backend_for(pool->device());
  Tensor x = Tensor::empty(*pool, {16, 14, 14, 32}, DType::f32, MemTag::activations);
  Tensor w = Tensor::empty(*pool, {32, 3, 3, 32}, DType::f32, MemTag::params);
  std::mt19937 rng(5);
  replica::testing::fill_random(x, rng);
  replica::testing::fill_random(w, rng);
  auto g = ops::ConvGeom::make(x.shape(), 32, 3, 3, 1, 1, "t");
  Tensor y1 = Tensor::empty(*pool, {16, 14, 14, 32}, DType::f32, MemTag::activations);
  Tensor y2 = Tensor::empty(*pool, {16, 14, 14, 32}, DType::f32, MemTag::activations);
  ops::set_intra_op_threads(1);
  be.conv2d_forward(x, w, y1, g, *pool);
  ops::set_intra_op_threads(2);
  EXPECT_EQ(ops::intra_op_threads(), 2);
  be.conv2d_forward(x, w, y2, g, *pool);
  ops::set_intra_op_threads(1);
  EXPECT_EQ(0, std::memcmp(y1.raw(), y2.raw(), y1.nbytes())) << "threads split rows, never a sum";
  EXPECT_THROW(ops::set_intra_op_threads(0), ConfigError);
}

// Batch norm and the elementwise ops spread row blocks and tiles over intra-op threads; their
// per-channel sums fold the blocks' partials in block order, so 2 threads give 1 thread's bits.
TEST(Threads, BatchNormAndElementwiseGiveTheSameBitsOnTwoThreads) {
  if (!ops::intra_op_threads_supported()) GTEST_SKIP() << "built without OpenMP: one intra-op thread only";
  auto pool = replica::testing::test_pool();
  auto& be = ops::backend_for(pool->device());
  const Shape sh{8, 16, 16, 24};  // 2048 rows: 64 row blocks, 48 tiles: enough to be split
  const int64_t C = 24;
  for (DType dt : {DType::f32, DType::bf16}) {
    std::mt19937 rng(9);
    auto make = [&](Shape s, DType t, float lo, float hi) {
      Tensor f = Tensor::empty(*pool, s, DType::f32, MemTag::activations);
      replica::testing::fill_random(f, rng, lo, hi);
      if (t == DType::f32) return f;
      Tensor h = Tensor::empty(*pool, s, t, MemTag::activations);
      convert(f.raw(), DType::f32, h.raw(), t, static_cast<size_t>(f.numel()));
      return h;
    };
    Tensor x = make(sh, dt, -2.f, 2.f), dy0 = make(sh, dt, -1.f, 1.f), res = make(sh, dt, -1.f, 1.f);
    Tensor gamma = make({C}, dt, 0.5f, 1.5f), beta = make({C}, dt, -0.5f, 0.5f);
    std::vector<std::vector<char>> out[2];
    for (int threads : {1, 2}) {
      ops::set_intra_op_threads(threads);
      auto empty = [&](Shape s, DType t) { return Tensor::empty(*pool, s, t, MemTag::activations); };
      Tensor y = empty(sh, dt), mean = empty({C}, DType::f32), inv = empty({C}, DType::f32);
      Tensor rm = Tensor::zeros(*pool, {C}, DType::f32, MemTag::activations), rv = Tensor::zeros(*pool, {C}, DType::f32, MemTag::activations);
      be.batchnorm_forward_train(x, gamma, beta, y, mean, inv, rm, rv, 0.1f, 1e-5f, nullptr, Tensor(), true);
      Tensor dy = empty(sh, dt), dx = empty(sh, dt), sum = empty(sh, dt);
      std::memcpy(dy.raw(), dy0.raw(), dy0.nbytes());
      Tensor dg = Tensor::zeros(*pool, {C}, DType::f32, MemTag::grads), db = Tensor::zeros(*pool, {C}, DType::f32, MemTag::grads);
      be.batchnorm_backward(dy, x, gamma, mean, inv, dx, dg, db, nullptr, y);
      be.add_relu(dx, res, sum);
      auto& o = out[threads - 1];
      for (const Tensor* t : {&y, &mean, &inv, &rm, &rv, &dy, &dx, &dg, &db, &sum})
        o.emplace_back(static_cast<const char*>(t->raw()), static_cast<const char*>(t->raw()) + t->nbytes());
    }
    ops::set_intra_op_threads(1);
    const char* names[] = {"y", "save_mean", "save_invstd", "running_mean", "running_var", "dy (masked)", "dx", "dgamma", "dbeta", "add_relu"};
    for (size_t i = 0; i < out[0].size(); ++i) EXPECT_TRUE(out[0][i] == out[1][i]) << dtype_name(dt) << " " << names[i];
  }
}

TEST(Checkpointing, BitIdenticalGradientsWithLessActivationMemory) {
  struct Result {
    std::vector<float> grads, buffers;
    size_t act_peak;
  };
  auto run = [](int every) {
    auto pool = replica::testing::test_pool();
    auto model = models::make_resnet({.arch = "resnet20", .height = 16, .width = 16, .base_width = 8,
                                      .checkpoint_every = every});
    model->materialize(*pool, 3);
    Tensor x = Tensor::empty(*pool, {8, 16, 16, 1}, DType::f32, MemTag::other);
    std::mt19937 rng(2);
    replica::testing::fill_random(x, rng);
    pool->reset_peaks();
    nn::Context ctx(*pool, ops::backend_for(pool->device()), true);
    Tensor y = model->forward(ctx, x);
    Tensor d = Tensor::empty(*pool, y.shape(), DType::f32, MemTag::activations);
    replica::testing::fill_random(d, rng);
    model->zero_grad();
    model->backward(ctx, d);
    EXPECT_EQ(ctx.saved_count(), 0u);
    Result r;
    r.grads.assign(model->grads().data<float>(), model->grads().data<float>() + model->num_params());
    r.buffers.assign(model->buffers().data<float>(), model->buffers().data<float>() + model->num_buffers());
    r.act_peak = pool->stats().tags[static_cast<int>(MemTag::activations)].peak_in_use;
    return r;
  };
  Result plain = run(0), blocks = run(1), every3 = run(3);
  EXPECT_EQ(blocks.grads, plain.grads) << "recomputation must reproduce every gradient bit for bit";
  EXPECT_EQ(every3.grads, plain.grads);
  EXPECT_EQ(blocks.buffers, plain.buffers) << "running statistics updated once, not twice";
  std::printf("activation peak: none %zu, every:3 %zu, blocks %zu bytes\n", plain.act_peak, every3.act_peak,
              blocks.act_peak);
  EXPECT_LT(blocks.act_peak, plain.act_peak * 6 / 10);
  EXPECT_LT(every3.act_peak, plain.act_peak);
}
