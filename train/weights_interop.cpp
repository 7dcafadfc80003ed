// PyTorch-named safetensors export and import: name mapping, KRSC <-> OIHW, dtype conversion.
#include "train/weights_interop.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "core/dtype.h"
#include "core/errors.h"
#include "core/safetensors.h"
#include "ops/models/resnet.h"

namespace replica::train {

namespace {

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

std::vector<int64_t> dims_of(const Shape& s) {
  std::vector<int64_t> d;
  for (int i = 0; i < s.rank(); ++i) d.push_back(s[i]);
  return d;
}

// Replaces the first occurrence of `from` (a whole dotted component run) by `to`.
std::string replace_part(std::string s, const std::string& from, const std::string& to) {
  const auto at = s.find(from);
  if (at != std::string::npos) s.replace(at, from.size(), to);
  return s;
}

DType dtype_of(const std::string& st) {
  if (st == "F32") return DType::f32;
  if (st == "F16") return DType::f16;
  if (st == "BF16") return DType::bf16;
  throw ConfigError("export dtype '" + st + "': use fp32, fp16 or bf16");
}

// One tensor of the model as PyTorch sees it.
struct Entry {
  std::string name;             // PyTorch's
  std::vector<int64_t> shape;   // PyTorch's (OIHW for filters)
  bool filter = false;          // KRSC here: transposed
  bool param = true;            // in the parameter buffer (else the buffer of statistics)
  int64_t offset = 0, numel = 0;
  std::vector<int64_t> ours;    // the shape here
};

std::vector<Entry> entries(nn::Model& model) {
  std::vector<Entry> out;
  for (const auto& p : model.registry().params()) {
    Entry e;
    e.name = pytorch_name(model.name(), p.name);
    e.ours = dims_of(p.shape);
    e.filter = p.shape.rank() == 4;
    e.shape = e.filter ? std::vector<int64_t>{e.ours[0], e.ours[3], e.ours[1], e.ours[2]} : e.ours;
    e.offset = p.offset;
    e.numel = p.shape.numel();
    out.push_back(e);
  }
  for (const auto& b : model.registry().buffers()) {
    Entry e;
    e.name = pytorch_name(model.name(), b.name);
    e.ours = dims_of(b.shape);
    e.shape = e.ours;
    e.param = false;
    e.offset = b.offset;
    e.numel = b.shape.numel();
    out.push_back(e);
  }
  return out;
}

// Copies one tensor between replica's layout (`ours`) and PyTorch's (`theirs`): filters are KRSC
// here and KCRS (OIHW) there, everything else is the same. `out` picks the direction.
void to_pytorch_layout(const Entry& e, float* ours, float* theirs, bool out) {
  if (!e.filter) {
    if (out) std::memcpy(theirs, ours, static_cast<size_t>(e.numel) * sizeof(float));
    else std::memcpy(ours, theirs, static_cast<size_t>(e.numel) * sizeof(float));
    return;
  }
  const int64_t K = e.ours[0], R = e.ours[1], S = e.ours[2], C = e.ours[3];
  for (int64_t k = 0; k < K; ++k)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t c = 0; c < C; ++c) {
          float& here = ours[((k * R + r) * S + s) * C + c];
          float& there = theirs[((k * C + c) * R + r) * S + s];
          if (out) there = here;
          else here = there;
        }
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

// The batch norms' num_batches_tracked names, one per running_mean.
std::vector<std::string> batch_counters(const std::vector<Entry>& es) {
  std::vector<std::string> out;
  const std::string suffix = ".running_mean";
  for (const auto& e : es)
    if (e.name.size() > suffix.size() && e.name.compare(e.name.size() - suffix.size(), suffix.size(), suffix) == 0)
      out.push_back(e.name.substr(0, e.name.size() - suffix.size()) + ".num_batches_tracked");
  return out;
}

}  // namespace

std::string pytorch_name(const std::string& arch, const std::string& n) {
  if (starts_with(n, "stem.conv.")) return "conv1." + n.substr(10);
  if (starts_with(n, "stem.bn.")) return "bn1." + n.substr(8);
  if (models::imagenet_style(arch)) return replace_part(n, ".shortcut.", ".downsample.");
  return n;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> pytorch_layout(nn::Model& model) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  const auto es = entries(model);
  for (const auto& e : es) out.emplace_back(e.name, e.shape);
  for (const auto& n : batch_counters(es)) out.emplace_back(n, std::vector<int64_t>{});
  return out;
}

std::string export_safetensors(nn::Model& model, const ExportOptions& o) {
  const DType out_dt = dtype_of(o.dtype);
  std::string params = tensor_to_bytes(model.params().view(0, {model.num_params()}));
  std::string buffers = tensor_to_bytes(model.buffers().view(0, {model.num_buffers()}));
  std::vector<safetensors::TensorData> ts;
  const auto es = entries(model);
  for (const auto& e : es) {
    float* src = reinterpret_cast<float*>((e.param ? params : buffers).data()) + e.offset;
    std::vector<float> v(static_cast<size_t>(e.numel));
    to_pytorch_layout(e, src, v.data(), true);
    std::string bytes(v.size() * dtype_size(out_dt), '\0');
    convert(v.data(), DType::f32, bytes.data(), out_dt, v.size());
    ts.push_back({e.name, o.dtype, e.shape, std::move(bytes)});
  }
  for (const auto& name : batch_counters(es)) {
    std::string b(8, '\0');
    std::memcpy(b.data(), &o.num_batches_tracked, 8);
    ts.push_back({name, "I64", {}, std::move(b)});
  }
  return safetensors::serialize(std::move(ts), {{"format", "pt"}});
}

ImportReport import_safetensors(nn::Model& model, std::string_view bytes, const std::string& source,
                                const ImportOptions& o) {
  const safetensors::File f = safetensors::parse(bytes, source);
  const auto es = entries(model);
  const auto counters = batch_counters(es);
  std::map<std::string, const Entry*> want;
  for (const auto& e : es) want[e.name] = &e;
  std::vector<std::string> problems;
  auto problem = [&](const std::string& p) { problems.push_back(p); };
  ImportReport rep;
  std::string params = tensor_to_bytes(model.params().view(0, {model.num_params()}));
  std::string buffers = tensor_to_bytes(model.buffers().view(0, {model.num_buffers()}));
  std::map<std::string, bool> found;
  bool first_counter = true;
  for (const auto& t : f.tensors) {
    if (std::find(counters.begin(), counters.end(), t.name) != counters.end()) {
      if (t.dtype != "I64" || t.numel() != 1) problem(t.name + ": " + t.dtype + " " + shape_str(t.shape) + ", expected I64 []");
      else if (first_counter) std::memcpy(&rep.num_batches_tracked, t.data.data(), 8), first_counter = false;
      continue;
    }
    const auto it = want.find(t.name);
    if (it == want.end()) {
      problem(t.name + ": not in a " + model.name() + " (file " + shape_str(t.shape) + ")");
      continue;
    }
    const Entry& e = *it->second;
    found[e.name] = true;
    if (t.shape != e.shape) {
      if (o.allow_new_classifier && starts_with(e.name, "fc.")) {
        rep.kept.push_back(e.name + " (file " + shape_str(t.shape) + ", model " + shape_str(e.shape) + ")");
        continue;
      }
      problem(e.name + ": file " + shape_str(t.shape) + ", model " + shape_str(e.shape));
      continue;
    }
    DType dt;
    if (t.dtype == "F32") dt = DType::f32;
    else if (t.dtype == "F16") dt = DType::f16;
    else if (t.dtype == "BF16") dt = DType::bf16;
    else {
      problem(e.name + ": dtype " + t.dtype + " (use F32, F16 or BF16)");
      continue;
    }
    if (rep.dtype.empty()) rep.dtype = t.dtype;
    std::vector<float> v(static_cast<size_t>(e.numel));
    convert(t.data.data(), dt, v.data(), DType::f32, v.size());
    float* dst = reinterpret_cast<float*>((e.param ? params : buffers).data()) + e.offset;
    to_pytorch_layout(e, dst, v.data(), false);
    rep.tensors++;
  }
  for (const auto& e : es)
    if (!found.count(e.name)) problem(e.name + ": missing from the file (model " + shape_str(e.shape) + ")");
  if (!problems.empty()) {
    std::string m = source + ": does not fit a " + model.name() + " (" + std::to_string(problems.size()) +
                    " mismatches; the model's names are PyTorch's, see train/weights_interop.h):";
    for (size_t i = 0; i < problems.size() && i < 6; ++i) m += "\n  " + problems[i];
    if (problems.size() > 6) m += "\n  ... and " + std::to_string(problems.size() - 6) + " more";
    throw IoError(m);
  }
  tensor_from_bytes(model.params().view(0, {model.num_params()}), params.data(), params.size());
  tensor_from_bytes(model.buffers().view(0, {model.num_buffers()}), buffers.data(), buffers.size());
  model.refresh_compute_copy();
  return rep;
}

}  // namespace replica::train
