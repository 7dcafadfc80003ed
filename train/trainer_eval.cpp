// Trainer: evaluation on the test split, on every replica's batch-norm statistics averaged over
// the replicas (the same model everywhere) and never changing the training state.
#include "train/trainer.h"

#include <cstring>

#include "train/averaged_statistics.h"
#include "train/model_io.h"

namespace replica::train {

EvalResult Trainer::evaluate_on(parallel::Replica& rep) {
  auto& st = states_[rep.local_index()];
  fault_point(rep, "eval");
  return with_averaged_statistics(rep, *st.model, [&] { return evaluate_averaged(rep); });
}

EvalResult Trainer::evaluate_averaged(parallel::Replica& rep) {
  auto& st = states_[rep.local_index()];
  const int R = rep.world();
  const int64_t eb = cfg_.train.eval_batch, N = test_->size();
  const Shape s = test_->sample_shape();
  double sums[4] = {0, 0, 0, 0};
  for (int64_t j = 0; j * eb * R < N; ++j) {
    const int64_t lo = (j * R + rep.rank()) * eb, hi = std::min(N, lo + eb);
    if (lo >= hi) continue;
    std::vector<int64_t> idx;
    for (int64_t i = lo; i < hi; ++i) idx.push_back(i);
    Tensor x = Tensor::empty(st.input_pool(rep), {hi - lo, s[0], s[1], s[2]}, DType::f32, MemTag::data);
    Tensor y = Tensor::empty(st.input_pool(rep), {hi - lo}, DType::i32, MemTag::data);
    data::load_samples(*test_, idx, aug_, false, cfg_.train.seed, 0, x.data<float>(), y.data<int32_t>());
    auto e = st.step->eval_batch(to_pool(x, rep.pool(), MemTag::data), to_pool(y, rep.pool(), MemTag::data));
    sums[0] += e.loss_sum;
    sums[1] += e.correct;
    sums[2] += e.count;
    sums[3] += e.correct5;
  }
  float f[4] = {static_cast<float>(sums[0]), static_cast<float>(sums[1]), static_cast<float>(sums[2]),
                static_cast<float>(sums[3])};
  if (R > 1) rep.psum(f, 4);
  return {f[0] / f[2], f[1] / f[2], f[3] / f[2], static_cast<int64_t>(f[2])};
}

EvalResult Trainer::evaluate_ema(parallel::Replica& rep) {
  auto& st = states_[rep.local_index()];
  nn::Model& model = *st.model;
  // The live weights whole (every replica, sharded or not) and the average's, then the average
  // loaded as the model (load_masters: a shard takes its range, the 16-bit copy is rounded whole),
  // evaluated on its statistics averaged over the replicas, and the live weights put back.
  const std::string live = whole_of(rep, model.params()), average = whole_of(rep, st.ema->params());
  const std::string live_buffers = tensor_to_bytes(model.buffers());
  std::vector<float> w(average.size() / sizeof(float));
  std::memcpy(w.data(), average.data(), average.size());
  model.load_masters(w.data());
  copy_tensor(st.ema->buffers(), model.buffers(), &rep.stream());
  struct PutBack {
    nn::Model& model;
    const std::string& live;
    const std::string& buffers;
    ~PutBack() {
      std::vector<float> v(live.size() / sizeof(float));
      std::memcpy(v.data(), live.data(), live.size());
      model.load_masters(v.data());
      tensor_from_bytes(model.buffers(), buffers.data(), buffers.size());
    }
  } put_back{model, live, live_buffers};
  return with_averaged_statistics(rep, model, [&] { return evaluate_averaged(rep); });
}

void Trainer::save_ema_model(parallel::Replica& rep) {
  auto& st = states_[rep.local_index()];
  const std::string average = whole_of(rep, st.ema->params());
  std::string b = tensor_to_bytes(st.ema->buffers());
  auto* f = reinterpret_cast<float*>(b.data());
  const size_t n = b.size() / sizeof(float);
  if (rep.world() > 1) rep.pmean(f, n);  // the statistics averaged, as model.bin's
  if (rep.rank() != 0) return;
  const Tensor params = Tensor::wrap(const_cast<char*>(average.data()),
                                     {static_cast<int64_t>(average.size() / sizeof(float))}, DType::f32, Device{});
  const Tensor buffers = Tensor::wrap(f, {static_cast<int64_t>(n)}, DType::f32, Device{});
  save_model(*st.model, params, buffers, cfg_.train.run_dir + "/model_ema.bin");
}

EvalResult Trainer::evaluate() {
  EvalResult r;
  group_->run([&](parallel::Replica& rep) {
    auto e = evaluate_on(rep);
    if (rep.rank() == 0) r = e;
  });
  return r;
}

}  // namespace replica::train
