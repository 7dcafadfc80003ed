// ReplicaGroup: persistent replica threads with a generation counter for jobs.
#include "parallel/replica_group.h"

#include <pthread.h>
#include <sched.h>

#include "core/pools.h"
#include "parallel/host/host_communicator.h"

namespace replica::parallel {

ReplicaGroup::ReplicaGroup(const std::vector<Device>& devices, GroupOptions opts) : pin_(opts.pin_threads) {
  if (devices.empty()) throw ConfigError("parallel.devices: no devices given");
  bool any_cuda = false;
  for (auto& d : devices) any_cuda |= d.kind == DeviceKind::cuda;
  if (any_cuda)
    throw ConfigError("parallel.devices: GPU replicas need the NCCL communicator, which this build "
                      "does not have yet; use cpu:N");
  HostCommOptions co;
  co.timeout = opts.comm_timeout;
  auto comms = make_host_communicators(static_cast<int>(devices.size()), co);
  pin_ = pin_ && static_cast<int>(devices.size()) <= host_core_count();
  for (size_t r = 0; r < devices.size(); ++r) {
    auto rep = std::make_unique<Replica>();
    rep->rank_ = static_cast<int>(r);
    rep->device_ = devices[r];
    rep->pool_ = make_pool(devices[r], devices[r].kind == DeviceKind::cpu ? opts.cpu_pool : opts.cuda_pool);
    rep->stream_ = make_stream(devices[r]);
    rep->comm_ = std::move(comms[r]);
    replicas_.push_back(std::move(rep));
  }
  errors_.resize(devices.size());
  for (size_t r = 0; r < devices.size(); ++r) threads_.emplace_back([this, r] { worker(static_cast<int>(r)); });
}

ReplicaGroup::~ReplicaGroup() {
  {
    std::lock_guard<std::mutex> lock(m_);
    stop_ = true;
  }
  cv_start_.notify_all();
  for (auto& t : threads_) t.join();
}

void ReplicaGroup::worker(int r) {
  if (pin_ && replicas_[r]->device_.kind == DeviceKind::cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(r % host_core_count(), &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort
  }
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(Replica&)>* job;
    {
      std::unique_lock<std::mutex> lock(m_);
      cv_start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    std::exception_ptr err;
    try {
      (*job)(*replicas_[r]);
    } catch (const CommError&) {
      err = std::current_exception();
    } catch (const std::exception& e) {
      err = std::current_exception();
      replicas_[r]->comm_->abort("replica " + std::to_string(r) + " (" + replicas_[r]->device_.str() +
                                 ") failed: " + e.what());
    } catch (...) {
      err = std::current_exception();
      replicas_[r]->comm_->abort("replica " + std::to_string(r) + " failed");
    }
    std::lock_guard<std::mutex> lock(m_);
    if (err) {
      errors_[r] = err;
      error_order_.push_back(r);
    }
    if (--running_ == 0) cv_done_.notify_all();
  }
}

void ReplicaGroup::run(const std::function<void(Replica&)>& fn) {
  std::unique_lock<std::mutex> lock(m_);
  if (broken_)
    throw Error("ReplicaGroup: an earlier run failed and aborted the communicator; create a new group");
  job_ = &fn;
  running_ = size();
  std::fill(errors_.begin(), errors_.end(), nullptr);
  error_order_.clear();
  generation_++;
  cv_start_.notify_all();
  cv_done_.wait(lock, [&] { return running_ == 0; });
  if (error_order_.empty()) return;
  broken_ = true;
  // Report the replica whose own error started it: prefer a non-communication error.
  int who = error_order_.front();
  for (int r : error_order_) {
    try {
      std::rethrow_exception(errors_[r]);
    } catch (const CommError&) {
    } catch (...) {
      who = r;
      break;
    }
  }
  try {
    std::rethrow_exception(errors_[who]);
  } catch (const std::exception& e) {
    throw ReplicaError(who, "replica " + std::to_string(who) + " (" + replicas_[who]->device_.str() +
                                "): " + e.what());
  }
}

}  // namespace replica::parallel
