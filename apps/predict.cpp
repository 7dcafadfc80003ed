// `replica predict`: a trained model on image files (predict.h).
#include "apps/predict.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>

#include "core/device.h"
#include "core/dtype.h"
#include "core/errors.h"
#include "core/file_io.h"
#include "core/json.h"
#include "core/pools.h"
#include "core/tensor.h"
#include "data/image_codec.h"
#include "data/image_transforms.h"
#include "ops/backend.h"
#include "ops/nn/context.h"
#include "train/config.h"
#include "train/factory.h"
#include "train/model_io.h"

namespace replica::apps {

namespace fs = std::filesystem;

std::vector<std::string> builtin_class_names(const std::string& dataset) {
  if (dataset == "fashion-mnist")
    return {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"};
  if (dataset == "mnist") return {"0", "1", "2", "3", "4", "5", "6", "7", "8", "9"};
  if (dataset == "cifar10")
    return {"airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"};
  return {};
}

namespace {

// The model's input (H, W, C) and class count from the configuration, without reading the data set.
struct ModelInput {
  int64_t H = 0, W = 0, C = 0, classes = 0;
  int resize = 0;  // the shorter side before the centre crop
};

ModelInput model_input(const train::RunConfig& cfg, int64_t class_count) {
  const auto& d = cfg.data;
  ModelInput m;
  if (d.dataset == "folder" || d.dataset == "packed") {
    m.H = m.W = d.image_size;
    m.C = 3;
    m.resize = d.eval_resize ? static_cast<int>(d.eval_resize) : static_cast<int>(std::lround(d.image_size / 0.875));
  } else if (d.dataset == "fashion-mnist" || d.dataset == "mnist") {
    m.H = m.W = 28;
    m.C = 1;
  } else if (d.dataset == "cifar10") {
    m.H = m.W = 32;
    m.C = 3;
  } else {  // synthetic
    m.H = d.synthetic_shape[0];
    m.W = d.synthetic_shape[1];
    m.C = d.synthetic_shape[2];
  }
  if (!m.resize) m.resize = static_cast<int>(std::min(m.H, m.W));  // an image of the model's size is read as it is
  m.classes = class_count;
  return m;
}

std::vector<std::string> read_lines(const std::string& path, const std::string& what) {
  std::vector<std::string> out;
  std::string text = read_file(path, what), line;
  for (char c : text) {
    if (c == '\n') {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      out.push_back(line);
      line.clear();
    } else {
      line += c;
    }
  }
  if (!line.empty()) out.push_back(line);
  while (!out.empty() && out.back().empty()) out.pop_back();
  return out;
}

// The files to predict, in the order given; a folder's regular files sorted, recursively.
std::vector<std::string> list_inputs(const std::vector<std::string>& inputs) {
  std::vector<std::string> files;
  for (const auto& in : inputs) {
    std::error_code ec;
    if (fs::is_directory(in, ec)) {
      std::vector<std::string> found;
      for (auto it = fs::recursive_directory_iterator(in, fs::directory_options::skip_permission_denied, ec);
           !ec && it != fs::recursive_directory_iterator(); it.increment(ec))
        if (it->is_regular_file(ec)) found.push_back(it->path().string());
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else if (fs::exists(in, ec)) {
      files.push_back(in);
    } else {
      throw IoError(in + ": no such file or folder");
    }
  }
  return files;
}

// One image file as the model's input: decoded, the shorter side resized and centre-cropped,
// gray when the model takes one channel (PIL's "L" weights), normalised. Throws IoError naming it.
void load_image(const std::string& path, const ModelInput& m, const train::DataConfig& d, float* out) {
  const std::string bytes = read_file(path, "image");
  if (data::sniff_image(bytes) == data::ImageKind::unknown)
    throw IoError(path + ": not a JPEG or PNG image");
  const data::RgbImage img = data::decode_image(bytes, path);
  if (m.H != m.W) throw ConfigError("predict: the model's input is " + std::to_string(m.H) + "x" + std::to_string(m.W) +
                                    "; only square inputs are cropped");
  const data::CropBox box = data::center_crop(img.width, img.height, m.resize, static_cast<int>(m.H));
  std::vector<float> rgb(static_cast<size_t>(m.H * m.W * 3));
  data::resample(img, box, static_cast<int>(m.W), static_cast<int>(m.H), false, rgb.data());
  for (int64_t p = 0; p < m.H * m.W; ++p) {
    const float* px = rgb.data() + p * 3;
    float* o = out + p * m.C;
    if (m.C == 1) {
      // A gray file decodes to three equal channels: read it as it is; colour goes through luma.
      o[0] = (px[0] == px[1] && px[1] == px[2]) ? px[0] : 0.299f * px[0] + 0.587f * px[1] + 0.114f * px[2];
    } else {
      for (int64_t c = 0; c < m.C; ++c) o[c] = px[std::min<int64_t>(c, 2)];
    }
    if (!d.mean.empty())
      for (int64_t c = 0; c < m.C; ++c)
        o[c] = (o[c] - d.mean[static_cast<size_t>(c)]) / d.std[static_cast<size_t>(c)];
  }
}

Device pick_device(const std::string& spec) {
  if (spec == "auto") {
    if (cuda_compiled() && !cuda_devices().empty()) return {DeviceKind::cuda, 0};
    return {DeviceKind::cpu, 0};
  }
  const auto devs = parse_devices(spec);
  if (devs.size() != 1) throw ConfigError("--device " + spec + ": name one device (cpu, cuda:0, ...)");
  return devs[0];
}

}  // namespace

int predict(const PredictOptions& o) {
  if (o.model.empty()) throw ConfigError("predict: give the model file (RUN_DIR/model.bin)");
  if (o.inputs.empty()) throw ConfigError("predict: give one or more image files or folders after the model");
  if (o.top < 1) throw ConfigError("--top " + std::to_string(o.top) + ": use 1 or more");
  if (o.batch < 1) throw ConfigError("--batch " + std::to_string(o.batch) + ": use 1 or more");
  const fs::path run_dir = fs::path(o.model).parent_path();
  std::string config = o.config;
  if (config.empty()) {
    const fs::path beside = run_dir / "config.yaml";
    if (!fs::exists(beside))
      throw ConfigError("predict: " + o.model + " has no config.yaml beside it; give the run's configuration with --config");
    config = beside.string();
  }
  const train::RunConfig cfg = train::load_config(config, o.sets);
  // Class names: --classes, the run's classes.txt (class folders), the data set's own, or numbers.
  std::vector<std::string> names;
  if (!o.classes.empty()) names = read_lines(o.classes, "--classes");
  else if (fs::exists(run_dir / "classes.txt")) names = read_lines((run_dir / "classes.txt").string(), "classes.txt");
  else names = builtin_class_names(cfg.data.dataset);
  int64_t classes = static_cast<int64_t>(names.size());
  if (names.empty()) {
    if (cfg.data.dataset == "synthetic") classes = cfg.data.synthetic_classes;
    else throw ConfigError("predict: no class list for " + o.model + "; give --classes FILE (one name per line, label order)");
    for (int64_t k = 0; k < classes; ++k) names.push_back("class " + std::to_string(k));
  }
  const ModelInput m = model_input(cfg, classes);

  const Device dev = pick_device(o.device);
  PoolOptions po = train::pool_options(cfg.memory, dev.kind);
  po.mode = AllocatorMode::growth;  // a handful of batches: take what they need
  auto pool = make_pool(dev, po);
  auto host = dev.kind == DeviceKind::cpu ? nullptr : make_pool({DeviceKind::cpu, 0}, PoolOptions{});
  const DType compute = parse_dtype(cfg.train.precision);
  auto model = train::make_model(cfg, {m.H, m.W, m.C}, classes);
  model->materialize(*pool, cfg.train.seed, compute);
  try {
    train::load_model(*model, o.model);
  } catch (const IoError& e) {
    throw IoError(std::string(e.what()) + (o.classes.empty() ? "" : " (is --classes the list it was trained with?)"));
  }
  auto& be = ops::backend_for(dev);

  const std::vector<std::string> files = list_inputs(o.inputs);
  const int top = static_cast<int>(std::min<int64_t>(o.top, classes));
  int64_t done = 0, skipped = 0;
  if (!o.json) std::printf("# %s (%s) on %s: top %d of %ld classes\n", o.model.c_str(), model->name().c_str(),
                           dev.str().c_str(), top, (long)classes);
  const int64_t per = m.H * m.W * m.C;
  for (size_t first = 0; first < files.size();) {
    std::vector<std::string> batch;
    std::vector<float> x;
    while (first < files.size() && static_cast<int64_t>(batch.size()) < o.batch) {
      const std::string& f = files[first++];
      std::vector<float> one(static_cast<size_t>(per));
      try {
        load_image(f, m, cfg.data, one.data());
      } catch (const IoError& e) {
        if (o.strict) throw;
        std::fprintf(stderr, "replica predict: skipping %s\n", e.what());
        ++skipped;
        continue;
      }
      batch.push_back(f);
      x.insert(x.end(), one.begin(), one.end());
    }
    if (batch.empty()) continue;
    const int64_t n = static_cast<int64_t>(batch.size());
    Tensor in = Tensor::empty(host ? *host : *pool, {n, m.H, m.W, m.C}, DType::f32, MemTag::data);
    std::copy(x.begin(), x.end(), in.data<float>());
    Tensor dev_in = in;
    if (host) {
      dev_in = Tensor::empty(*pool, in.shape(), DType::f32, MemTag::data);
      copy_tensor(in, dev_in);
    }
    nn::Context ctx(*pool, be, /*training=*/false);
    ctx.act_dtype = compute;
    const Tensor logits = model->forward(ctx, dev_in);
    const std::string raw = tensor_to_bytes(logits);
    std::vector<float> z(static_cast<size_t>(n * classes));
    convert(raw.data(), logits.dtype(), z.data(), DType::f32, z.size());
    for (int64_t i = 0; i < n; ++i) {
      const float* row = z.data() + i * classes;
      const double mx = *std::max_element(row, row + classes);
      double sum = 0;
      for (int64_t k = 0; k < classes; ++k) sum += std::exp(static_cast<double>(row[k]) - mx);
      std::vector<int64_t> order(static_cast<size_t>(classes));
      std::iota(order.begin(), order.end(), 0);
      // Larger logit first; a tie goes to the lower class index, as evaluation's top-1 and top-5.
      std::partial_sort(order.begin(), order.begin() + top, order.end(),
                        [&](int64_t a, int64_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
      if (o.json) {
        Json j;
        j["file"] = batch[static_cast<size_t>(i)];
        Json list = Json::array();
        for (int t = 0; t < top; ++t) {
          const int64_t k = order[static_cast<size_t>(t)];
          list.push_back({{"class", names[static_cast<size_t>(k)]}, {"index", k},
                          {"probability", json_number(std::exp(static_cast<double>(row[k]) - mx) / sum)}});
        }
        j["top"] = list;
        std::printf("%s\n", json_line(j).c_str());
      } else {
        std::printf("%s", batch[static_cast<size_t>(i)].c_str());
        for (int t = 0; t < top; ++t) {
          const int64_t k = order[static_cast<size_t>(t)];
          std::printf("%s%s %.1f%%", t ? ", " : "  ", names[static_cast<size_t>(k)].c_str(),
                      100.0 * std::exp(static_cast<double>(row[k]) - mx) / sum);
        }
        std::printf("\n");
      }
    }
    done += n;
  }
  if (!o.json || skipped)
    std::fprintf(o.json ? stderr : stdout, "# %ld image(s) predicted, %ld skipped\n", (long)done, (long)skipped);
  return done == 0 && !files.empty() ? 1 : 0;
}

}  // namespace replica::apps
