// Sharding arithmetic, deterministic augmentation and the prefetching replica loader.
#include "data/loader.h"

#include <chrono>

#include "core/errors.h"
#include "data/keyed_random.h"

namespace replica::data {

namespace {
// splitmix64: a well-mixed 64-bit hash, so (seed, epoch, index) streams are independent.
uint64_t mix(uint64_t x) { return KeyedRandom::hash(x); }
}  // namespace

Sharding::Sharding(int64_t n, int64_t micro_batch, int accumulation, int world, uint64_t seed, bool shuffle)
    : n_(n), micro_(micro_batch), accum_(accumulation), world_(world), seed_(seed), shuffle_(shuffle) {
  if (micro_batch < 1 || accumulation < 1 || world < 1)
    throw ConfigError("loader: micro_batch, accumulation steps and replicas must be >= 1");
  steps_ = n_ / global_batch();
  if (steps_ < 1)
    throw ConfigError("loader: the data set has " + std::to_string(n_) + " samples, fewer than one global batch of " +
                      std::to_string(global_batch()) + "; lower train.global_batch");
}

const std::vector<int64_t>& Sharding::permutation(int64_t epoch) const {
  std::lock_guard<std::mutex> lock(m_);
  if (cached_epoch_ != epoch) {
    perm_.resize(n_);
    for (int64_t i = 0; i < n_; ++i) perm_[i] = i;
    if (shuffle_) {
      // Fisher-Yates with our own draws (std::shuffle's sequence is library-specific).
      uint64_t state = mix(seed_ * 0x100000001b3ull ^ static_cast<uint64_t>(epoch));
      for (int64_t i = n_ - 1; i > 0; --i) {
        state = mix(state);
        int64_t j = static_cast<int64_t>(state % static_cast<uint64_t>(i + 1));
        std::swap(perm_[i], perm_[j]);
      }
    }
    cached_epoch_ = epoch;
  }
  return perm_;
}

std::vector<int64_t> Sharding::indices(int64_t epoch, int64_t step, int rank, int micro) const {
  if (step < 0 || step >= steps_) throw Error("Sharding: step " + std::to_string(step) + " outside the epoch");
  const auto& p = permutation(epoch);
  const int64_t start = step * global_batch() + (static_cast<int64_t>(rank) * accum_ + micro) * micro_;
  return std::vector<int64_t>(p.begin() + start, p.begin() + start + micro_);
}

void load_samples(const Dataset& ds, const std::vector<int64_t>& idx, const AugmentOptions& aug, bool augment,
                  uint64_t seed, int64_t epoch, float* out, int32_t* labels) {
  const Shape s = ds.sample_shape();
  const int64_t H = s[0], W = s[1], C = s[2], n = H * W * C;
  std::vector<float> tmp(n);
  for (size_t b = 0; b < idx.size(); ++b) {
    float* dst = out + b * n;
    if (augment && ds.own_augmentation()) {  // the data set's recipe, drawn from (seed, epoch, index)
      labels[b] = ds.get_train(idx[b], dst, mix(mix(seed ^ 0x5eedull) ^ mix(static_cast<uint64_t>(epoch) * 0x9e37ull) ^
                                                     static_cast<uint64_t>(idx[b])));
    } else {
      labels[b] = ds.get(idx[b], augment ? tmp.data() : dst);
    }
    if (augment && ds.own_augmentation()) {
      // cropped and flipped already
    } else if (augment && (aug.pad_crop > 0 || aug.hflip)) {
      uint64_t r = mix(mix(seed ^ 0xa5a5a5a5ull) ^ mix(static_cast<uint64_t>(epoch) * 0x9e37ull) ^
                       static_cast<uint64_t>(idx[b]));
      const int64_t span = 2 * aug.pad_crop + 1;
      const int64_t dy = aug.pad_crop ? static_cast<int64_t>(r % span) - aug.pad_crop : 0;
      const int64_t dx = aug.pad_crop ? static_cast<int64_t>((r >> 16) % span) - aug.pad_crop : 0;
      const bool flip = aug.hflip && ((r >> 40) & 1);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t w = 0; w < W; ++w) {
          const int64_t sh = h + dy, sw0 = flip ? W - 1 - w : w, sw = sw0 + dx;
          float* o = dst + (h * W + w) * C;
          if (sh < 0 || sh >= H || sw < 0 || sw >= W) {
            for (int64_t c = 0; c < C; ++c) o[c] = 0.f;  // zero padding, as torchvision pads pixels
          } else {
            const float* i = tmp.data() + (sh * W + sw) * C;
            for (int64_t c = 0; c < C; ++c) o[c] = i[c];
          }
        }
    } else if (augment) {
      std::copy(tmp.begin(), tmp.end(), dst);
    }
    // The policies' own stream: (seed, epoch, index) as every draw here, apart from the crop's.
    const uint64_t pkey = mix(mix(seed ^ 0x706f6cull) ^ mix(static_cast<uint64_t>(epoch) * 0x9e37ull) ^
                              static_cast<uint64_t>(idx[b]));
    if (augment) apply_policy(aug.policy, pkey, dst, H, W, C);  // on the 8-bit image, as torchvision
    if (!aug.mean.empty())
      for (int64_t p = 0; p < H * W; ++p)
        for (int64_t c = 0; c < C; ++c) dst[p * C + c] = (dst[p * C + c] - aug.mean[c]) / aug.std[c];
    if (augment) random_erase(aug.policy, pkey, dst, H, W, C);  // after Normalize, as torchvision's recipe
  }
}

ReplicaLoader::ReplicaLoader(const Dataset& ds, const Sharding& sharding, int rank, MemoryPool& pool,
                             AugmentOptions aug, uint64_t seed, int prefetch, int workers)
    : ds_(ds), sh_(sharding), rank_(rank), pool_(pool), aug_(std::move(aug)), seed_(seed),
      depth_(static_cast<size_t>(std::max(1, prefetch))), workers_(std::max(1, workers)) {
  const int64_t C = ds.sample_shape()[2];
  if (!aug_.mean.empty() && (static_cast<int64_t>(aug_.mean.size()) != C || aug_.std.size() != aug_.mean.size()))
    throw ConfigError("data.normalize: mean and std need " + std::to_string(C) + " values (one per channel) for " +
                      ds.name());
  if (aug_.policy.policy != AugmentPolicy::none && C != 1 && C != 3)
    throw ConfigError("data.augment: " + augment_policy_name(aug_.policy.policy) + " takes images of 1 or 3 channels; " +
                      ds.name() + " has " + std::to_string(C));
}

ReplicaLoader::~ReplicaLoader() { stop(); }

void ReplicaLoader::stop() {
  {
    std::lock_guard<std::mutex> lock(m_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(m_);
  queue_.clear();
  stop_ = false;
  error_ = nullptr;
}

void ReplicaLoader::begin_epoch(int64_t epoch, int64_t first_step) {
  stop();
  thread_ = std::thread([this, epoch, first_step] { produce(epoch, first_step); });
}

void ReplicaLoader::produce(int64_t epoch, int64_t first_step) {
  try {
    const Shape s = ds_.sample_shape();
    for (int64_t step = first_step; step < sh_.steps_per_epoch(); ++step)
      for (int micro = 0; micro < sh_.accumulation(); ++micro) {
        {
          std::unique_lock<std::mutex> lock(m_);
          cv_.wait(lock, [&] { return stop_ || queue_.size() < depth_; });
          if (stop_) return;
        }
        auto idx = sh_.indices(epoch, step, rank_, micro);
        const int64_t n = static_cast<int64_t>(idx.size());
        Batch b;
        b.images = Tensor::empty(pool_, {n, s[0], s[1], s[2]}, DType::f32, MemTag::data);
        const bool mixing = aug_.mix.enabled();
        b.labels = mixing ? Tensor::empty(pool_, {n, 2}, DType::i32, MemTag::data)
                          : Tensor::empty(pool_, {n}, DType::i32, MemTag::data);
        std::vector<int32_t> plain(mixing ? n : 0);  // the labels before they take their weights
        int32_t* labels = mixing ? plain.data() : b.labels.data<int32_t>();
        b.epoch = epoch;
        b.step = step;
        b.micro = micro;
        const int parts = static_cast<int>(std::min<int64_t>(workers_, n));
        if (parts <= 1) {
          load_samples(ds_, idx, aug_, true, seed_, epoch, b.images.data<float>(), labels);
        } else {  // each sample's content depends on its index only, so the split changes nothing
          const int64_t per = s.numel(), chunk = (n + parts - 1) / parts;
          std::vector<std::thread> ts;
          std::vector<std::exception_ptr> errs(parts);
          for (int p = 0; p < parts; ++p)
            ts.emplace_back([&, p] {
              try {
                const int64_t lo = p * chunk, hi = std::min(n, lo + chunk);
                if (lo >= hi) return;
                std::vector<int64_t> sub(idx.begin() + lo, idx.begin() + hi);
                load_samples(ds_, sub, aug_, true, seed_, epoch, b.images.data<float>() + lo * per, labels + lo);
              } catch (...) {
                errs[p] = std::current_exception();
              }
            });
          for (auto& t : ts) t.join();
          for (auto& e : errs)
            if (e) std::rethrow_exception(e);
        }
        if (mixing) {  // after the whole micro-batch is in: a pair's halves may come from two threads
          int32_t* lab2 = b.labels.data<int32_t>();
          for (int64_t i = 0; i < n; ++i) lab2[2 * i] = plain[i];
          mix_batch(aug_.mix, seed_, epoch, idx.data(), n, s[0], s[1], s[2], b.images.data<float>(), lab2);
        }
        std::lock_guard<std::mutex> lock(m_);
        queue_.push_back(std::move(b));
        cv_.notify_all();
      }
  } catch (...) {
    std::lock_guard<std::mutex> lock(m_);
    error_ = std::current_exception();
    cv_.notify_all();
  }
}

Batch ReplicaLoader::next() {
  auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(m_);
  cv_.wait(lock, [&] { return !queue_.empty() || error_; });
  wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (queue_.empty() && error_) std::rethrow_exception(error_);
  Batch b = std::move(queue_.front());
  queue_.pop_front();
  cv_.notify_all();
  return b;
}

}  // namespace replica::data
