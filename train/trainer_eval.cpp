// Trainer: evaluation on the test split, on every replica's batch-norm statistics averaged over
// the replicas (the same model everywhere) and never changing the training state.
#include "train/trainer.h"

#include "train/averaged_statistics.h"

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

EvalResult Trainer::evaluate() {
  EvalResult r;
  group_->run([&](parallel::Replica& rep) {
    auto e = evaluate_on(rep);
    if (rep.rank() == 0) r = e;
  });
  return r;
}

}  // namespace replica::train
