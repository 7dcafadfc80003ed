// Weights through PyTorch: a torchvision ResNet-50 (width 8) and a CIFAR ResNet-20 written by
// PyTorch (tests/reference/make_safetensors_fixtures.py) load here with PyTorch's names and
// reproduce its eval-mode logits; exporting what was imported gives the same bytes back; name,
// shape and dtype mismatches are errors that list them; the safetensors reader refuses damage.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <map>
#include <set>
#include <sstream>

#include "core/errors.h"
#include "core/file_io.h"
#include "core/pools.h"
#include "core/safetensors.h"
#include "ops/backend.h"
#include "ops/models/resnet.h"
#include "ops/nn/context.h"
#include "support/compare.h"
#include "train/config.h"
#include "train/trainer.h"
#include "train/weights_interop.h"

using namespace replica;
using replica::testing::rel_diff;

namespace {
std::string fixture(const std::string& name) {
  return read_file(std::string(REPLICA_SOURCE_DIR) + "/tests/fixtures/" + name, "fixture");
}

struct Case {
  const char* file;
  models::ResNetConfig cfg;
  double tolerance;  // of the logits, relative to the largest (support/compare.h)
};

std::vector<float> as_floats(const safetensors::TensorView& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  std::memcpy(v.data(), t.data.data(), t.data.size());
  return v;
}

class FromPyTorch : public ::testing::TestWithParam<Case> {};
}  // namespace

TEST_P(FromPyTorch, ReproducesItsEvalLogitsAndExportsTheSameBytes) {
  const Case c = GetParam();
  auto pool = make_pool({DeviceKind::cpu, 0}, PoolOptions{});
  auto model = models::make_resnet(c.cfg);
  model->materialize(*pool, 1);
  const std::string weights = fixture(std::string(c.file) + ".safetensors");
  const train::ImportReport rep = train::import_safetensors(*model, weights, c.file);
  EXPECT_EQ(rep.num_batches_tracked, 7);
  EXPECT_EQ(rep.dtype, "F32");
  EXPECT_TRUE(rep.kept.empty());

  const std::string io_bytes = fixture(std::string(c.file) + "_io.safetensors");
  const auto io = safetensors::parse(io_bytes, "io");
  const auto* in = io.find("input_nhwc");
  const auto* want = io.find("logits");
  ASSERT_TRUE(in && want);
  Tensor x = Tensor::empty(*pool, {in->shape[0], in->shape[1], in->shape[2], in->shape[3]}, DType::f32,
                           MemTag::activations);
  std::memcpy(x.raw(), in->data.data(), in->data.size());
  nn::Context ctx(*pool, ops::backend_for(pool->device()), /*training=*/false);
  Tensor logits = model->forward(ctx, x);
  const std::vector<float> w = as_floats(*want);
  ASSERT_EQ(static_cast<size_t>(logits.numel()), w.size());
  const double err = rel_diff(logits.data<float>(), w.data(), w.size());
  std::printf("%s: eval logits within %.3g of PyTorch's (relative to the largest)\n", c.file, err);
  EXPECT_LE(err, c.tolerance) << "eval-mode logits differ from PyTorch's";

  const std::string back = train::export_safetensors(*model, {.dtype = "F32", .num_batches_tracked = rep.num_batches_tracked});
  EXPECT_EQ(back.size(), weights.size());
  EXPECT_TRUE(back == weights) << "exporting the imported model must give the file back byte for byte";
}

INSTANTIATE_TEST_SUITE_P(
    Models, FromPyTorch,
    ::testing::Values(Case{"resnet20_torch", {.arch = "resnet20", .in_channels = 3, .num_classes = 10, .height = 32, .width = 32}, 1e-5},
                      Case{"resnet50w8_torch",
                           {.arch = "resnet50", .in_channels = 3, .num_classes = 10, .height = 64, .width = 64, .base_width = 8},
                           1e-5}),  // 2.8e-7 and 4.4e-7 measured (EPYC, fp32)
    [](const auto& info) { return std::string(info.param.file); });

// Every ImageNet-style model exports exactly torchvision's state_dict of the same name, names and
// shapes (what load_state_dict(strict=True) checks), 1000 classes at full size
// (tests/reference/make_torchvision_layouts.py).
TEST(WeightsInterop, EveryImageNetModelHasTorchvisionsLayout) {
  std::map<std::string, std::set<std::string>> want;
  std::istringstream in(fixture("torchvision_layouts.txt"));
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line[0] != '#') want[line.substr(0, line.find(' '))].insert(line.substr(line.find(' ') + 1));
  int archs = 0;
  for (const auto& arch : models::resnet_archs()) {
    if (!models::imagenet_style(arch)) continue;
    ASSERT_TRUE(want.count(arch)) << arch << " is not in the fixture";
    auto model = models::make_resnet({.arch = arch, .in_channels = 3, .num_classes = 1000, .height = 224, .width = 224});
    std::set<std::string> got;
    for (const auto& [name, shape] : train::pytorch_layout(*model)) {
      std::string dims;
      for (size_t i = 0; i < shape.size(); ++i) dims += (i ? "," : "") + std::to_string(shape[i]);
      got.insert(name + " " + (dims.empty() ? "-" : dims));
    }
    std::vector<std::string> missing, extra;
    std::set_difference(want[arch].begin(), want[arch].end(), got.begin(), got.end(), std::back_inserter(missing));
    std::set_difference(got.begin(), got.end(), want[arch].begin(), want[arch].end(), std::back_inserter(extra));
    EXPECT_TRUE(missing.empty() && extra.empty())
        << arch << ": " << missing.size() << " of torchvision's tensors missing (first: "
        << (missing.empty() ? "-" : missing[0]) << "), " << extra.size() << " extra (first: " << (extra.empty() ? "-" : extra[0]) << ")";
    ++archs;
  }
  EXPECT_EQ(archs, 9) << "resnet18/34/50/101/152, wide_resnet50_2/101_2, resnext50_32x4d, resnext101_32x8d";
}

TEST(WeightsInterop, NamesArePyTorchs) {
  EXPECT_EQ(train::pytorch_name("resnet50", "stem.conv.weight"), "conv1.weight");
  EXPECT_EQ(train::pytorch_name("resnet50", "stem.bn.running_var"), "bn1.running_var");
  EXPECT_EQ(train::pytorch_name("resnet50", "layer2.0.shortcut.0.weight"), "layer2.0.downsample.0.weight");
  EXPECT_EQ(train::pytorch_name("resnet20", "layer2.0.shortcut.1.bias"), "layer2.0.shortcut.1.bias");
  EXPECT_EQ(train::pytorch_name("resnet18", "fc.weight"), "fc.weight");
}

TEST(WeightsInterop, MismatchesAreListedWithBothShapes) {
  auto pool = make_pool({DeviceKind::cpu, 0}, PoolOptions{});
  // A ResNet-20 for 1-channel 28x28 images and 10 classes against the 3-channel fixture.
  auto model = models::make_resnet({.arch = "resnet20", .in_channels = 1, .num_classes = 10});
  model->materialize(*pool, 1);
  const std::string weights = fixture("resnet20_torch.safetensors");
  try {
    train::import_safetensors(*model, weights, "r20.safetensors");
    FAIL();
  } catch (const IoError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("r20.safetensors"), std::string::npos) << m;
    EXPECT_NE(m.find("conv1.weight: file [16, 3, 3, 3], model [16, 1, 3, 3]"), std::string::npos) << m;
  }
  // Another number of classes: an error, unless the classifier may be new (fine-tuning).
  auto five = models::make_resnet({.arch = "resnet20", .in_channels = 3, .num_classes = 5, .height = 32, .width = 32});
  five->materialize(*pool, 1);
  EXPECT_THROW(train::import_safetensors(*five, weights, "r20"), IoError);
  const auto rep = train::import_safetensors(*five, weights, "r20", {.allow_new_classifier = true});
  ASSERT_EQ(rep.kept.size(), 2u);
  const std::string kept = rep.kept[0] + "; " + rep.kept[1];
  EXPECT_NE(kept.find("fc.weight (file [10, 64], model [5, 64])"), std::string::npos) << kept;
  EXPECT_NE(kept.find("fc.bias (file [10], model [5])"), std::string::npos) << kept;
  // A ResNet-50 file is not a ResNet-20: the names say so.
  try {
    train::import_safetensors(*model, fixture("resnet50w8_torch.safetensors"), "r50");
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("not in a resnet20"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("more"), std::string::npos) << "a long list is cut: " << e.what();
  }
}

TEST(WeightsInterop, SixteenBitExportReadsBackWithinItsRounding) {
  auto pool = make_pool({DeviceKind::cpu, 0}, PoolOptions{});
  auto model = models::make_resnet({.arch = "resnet20", .in_channels = 3, .num_classes = 10, .height = 32, .width = 32});
  model->materialize(*pool, 1);
  train::import_safetensors(*model, fixture("resnet20_torch.safetensors"), "r20");
  const std::vector<float> before(model->params().data<float>(), model->params().data<float>() + model->num_params());
  for (const char* dt : {"F16", "BF16"}) {
    const std::string half = train::export_safetensors(*model, {.dtype = dt});
    const auto f = safetensors::parse(half, dt);
    EXPECT_EQ(f.find("conv1.weight")->dtype, dt);
    EXPECT_EQ(f.find("bn1.num_batches_tracked")->dtype, "I64");
    auto other = models::make_resnet({.arch = "resnet20", .in_channels = 3, .num_classes = 10, .height = 32, .width = 32});
    other->materialize(*pool, 2);
    const auto rep = train::import_safetensors(*other, half, dt);
    EXPECT_EQ(rep.dtype, dt);
    double worst = 0;
    for (int64_t i = 0; i < model->num_params(); ++i)
      worst = std::max(worst, std::fabs(double(other->params().data<float>()[i]) - before[i]) /
                                  std::max(1e-3, std::fabs(double(before[i]))));
    EXPECT_LE(worst, std::string(dt) == "F16" ? 1e-3 : 8e-3) << dt;
  }
}

TEST(Safetensors, DamageIsRefusedByName) {
  std::string good = safetensors::serialize({{"a", "F32", {2}, std::string(8, '\0')}, {"b", "I64", {}, std::string(8, '\0')}},
                                            {{"format", "pt"}});
  const auto f = safetensors::parse(good, "good");
  ASSERT_EQ(f.tensors.size(), 2u);
  EXPECT_EQ(f.tensors[0].name, "b") << "largest dtype first, as the reference writer";
  auto expect_error = [](std::string bytes, const char* needle) {
    try {
      safetensors::parse(bytes, "f.safetensors");
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("f.safetensors"), std::string::npos) << e.what();
    }
  };
  expect_error(good.substr(0, 5), "not a safetensors file");
  expect_error(good.substr(0, good.size() - 1), "data_offsets outside");
  expect_error(good + "x", "data bytes after the last tensor");
  std::string bad_dtype = good;
  bad_dtype.replace(bad_dtype.find("\"F32\""), 5, "\"F99\"");
  expect_error(bad_dtype, "unknown dtype 'F99'");
  std::string bad_shape = good;
  bad_shape.replace(bad_shape.find("[2]"), 3, "[3]");
  expect_error(bad_shape, "need 12 bytes");
  std::string huge = good;
  huge[7] = 1;
  expect_error(huge, "truncated");
  std::string bad_json = good;
  bad_json[9] = '[';
  expect_error(bad_json, "safetensors header, byte");
  // What the JSON library would accept but the reference reader refuses.
  auto with_header = [](const std::string& h) {
    std::string out(8, '\0');
    for (int k = 0; k < 8; ++k) out[k] = static_cast<char>((h.size() >> (8 * k)) & 0xff);
    return out + h;
  };
  expect_error(with_header(R"({"a":{"dtype":"F32","shape":[],"data_offsets":[0,0]},"a":{}})"), "'a' appears twice");
  expect_error(with_header(R"({"a":{"dtype":"F32","dtype":"F16","shape":[],"data_offsets":[0,0]}})"), "'dtype' appears twice");
  expect_error(with_header(R"({"a":{"dtype":"F32","shape":[[1]],"data_offsets":[0,4]}})"), "nested deeper");
  expect_error(with_header(R"({"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}})"), "not a non-negative integer");
  expect_error(with_header(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})"), "not a non-negative integer");
  expect_error(with_header(R"({"a":{"dtype":"F32","shape":[1]}})"), "needs dtype, shape and data_offsets");
  expect_error(with_header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})"), "unknown field 'x'");
  expect_error(with_header(R"({"__metadata__":{"k":1}})"), "is not a string");
  expect_error(with_header(R"([1])"), "not an object");
  expect_error(with_header(R"({"a":{"dtype":"F32","shape":[1e999],"data_offsets":[0,4]}})"), "safetensors header");
  // The names come back in the file's order (a JSON object's keys would sort), with escapes undone.
  const std::string two =
      with_header(R"({"z":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"\u00e9a\n":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})") +
      "xy";
  const auto ordered = safetensors::parse(two, "o");  // views into `two`
  ASSERT_EQ(ordered.tensors.size(), 2u);
  EXPECT_EQ(ordered.tensors[0].name, "z");
  EXPECT_EQ(ordered.tensors[1].name, "\xC3\xA9" "a\n");
  EXPECT_EQ(ordered.tensors[1].data, "y");
  // The writer refuses what would not read back.
  EXPECT_THROW(safetensors::serialize({{"a", "U8", {1}, "x"}, {"a", "U8", {1}, "y"}}, {}), Error);
  EXPECT_THROW(safetensors::serialize({{"__metadata__", "U8", {1}, "x"}}, {}), Error);
  EXPECT_THROW(safetensors::serialize({{std::string("a") + char(0xff), "U8", {1}, "x"}}, {}), Error);
}

// model.init_from: a run starts from another run's exported weights; with another number of
// classes the classifier is re-initialised (the rest is the file's), and every replica agrees.
TEST(WeightsInterop, InitFromStartsARunFromExportedWeights) {
  const std::string dir = ::testing::TempDir() + "replica_init_from";
  std::vector<std::string> base = {"model.width=4", "data.dataset=synthetic", "data.synthetic_shape=[8,8,1]",
                                   "data.synthetic_size=128", "data.mean=[0.5]", "data.std=[0.25]",
                                   "train.global_batch=32", "train.max_steps=2", "train.eval=false",
                                   "train.tensorboard=false", "checkpoint.every_epochs=0", "parallel.devices=cpu:2"};
  auto with = [&](std::vector<std::string> extra) {
    auto s = base;
    s.insert(s.end(), extra.begin(), extra.end());
    return train::parse_config("", "test", s);
  };
  train::Trainer first(with({"train.run_dir=" + dir + "/a"}), {.print = false});
  first.fit();
  const std::string file = dir + "/a.safetensors";
  write_file_atomic(file, train::export_safetensors(first.model(0)));
  const auto& reg = first.model(0).registry().params();
  const auto fc = std::find_if(reg.begin(), reg.end(), [](const auto& p) { return p.name == "fc.weight"; });
  ASSERT_NE(fc, reg.end());

  for (int classes : {10, 5}) {
    train::Trainer second(with({"train.run_dir=" + dir + "/b" + std::to_string(classes), "model.init_from=" + file,
                                "data.synthetic_classes=" + std::to_string(classes)}),
                          {.print = false});
    for (int r = 0; r < 2; ++r) {
      const float* a = first.model(0).params().data<float>();
      const float* b = second.model(r).params().data<float>();
      EXPECT_EQ(std::memcmp(a, b, fc->offset * sizeof(float)), 0) << "everything before the classifier is the file's";
      if (classes == 10) {
        EXPECT_EQ(std::memcmp(a, b, first.model(0).num_params() * sizeof(float)), 0) << "same classes: all of it";
      }
    }
    EXPECT_EQ(second.model(0).registry().params().back().shape[0], classes);
  }
}
