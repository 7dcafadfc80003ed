// ReplicaGroup: persistent replica threads with a generation counter for jobs.
#include "parallel/replica_group.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "core/cuda/runtime.h"
#include "core/env.h"
#include "core/log.h"
#include "core/pools.h"
#include "parallel/gradient_sync.h"
#include "parallel/host/host_communicator.h"
#include "parallel/recordable_communicator.h"
#include "parallel/solo_communicator.h"
#include "parallel/staged_communicator.h"
#include "parallel/mpi/mpi_communicator.h"
#include "parallel/nccl/nccl_communicator.h"

namespace replica::parallel {

void Replica::reduce(float* data, size_t n, ReduceOp op) {
  if (comm_->device_buffers() && !cuda::is_device_pointer(data)) return all_reduce_host(*comm_, pool_.get(), data, n, op);
  comm_->all_reduce(data, n, DType::f32, op);
}

void Replica::psum_on_stream(float* data, size_t n) {
  Communicator& c = lane();
  if (c.device_buffers() && cuda::is_device_pointer(data)) {
    c.all_reduce_async(data, n, DType::f32, ReduceOp::sum)->order_before(*stream_);
    return;
  }
  reduce(data, n, ReduceOp::sum);
}

void Replica::abort(const std::string& why) {
  comm_->abort(why);
  if (lane_) lane_->abort(why);
}

std::vector<float> Replica::all_gather(const float* data, size_t n) {
  std::vector<float> out(n * static_cast<size_t>(world()));
  if (comm_->device_buffers() && cuda::is_device_pointer(data)) {  // device in, host out
    Tensor r = Tensor::empty(*pool_, {static_cast<int64_t>(out.size())}, DType::f32, MemTag::other);
    comm_->all_gather(data, r.raw(), n, DType::f32);
    const std::string b = tensor_to_bytes(r);
    std::memcpy(out.data(), b.data(), b.size());
  } else {
    all_gather_host(*comm_, pool_.get(), data, out.data(), n);  // passes through without device buffers
  }
  return out;
}

namespace {
bool shares_a_gpu(const std::vector<Device>& devices) {
  for (size_t i = 0; i < devices.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (devices[i].kind == DeviceKind::cuda && devices[i] == devices[j]) return true;
  return false;
}

// Several replicas on one GPU (the multi-GPU paths run on a one-GPU machine): NCCL ranks sharing
// the GPU where the loaded NCCL allows it (2.30+, NCCL_MULTI_RANK_GPU_ENABLE), else collectives
// staged through host memory. Ranks that are threads of one process share its CUDA context, so
// their kernels run side by side; under MPI each process would need MPS, so that stays refused.
// REPLICA_SHARED_GPU=staged keeps the host staging on any NCCL.
bool shared_gpu_over_nccl() {
  const char* v = std::getenv("REPLICA_SHARED_GPU");
  const std::string how = v ? v : "";
  if (!how.empty() && how != "nccl" && how != "staged")
    throw ConfigError("REPLICA_SHARED_GPU=" + how + ": expected nccl or staged");
  return how != "staged" && nccl_shares_gpus();
}

std::vector<std::unique_ptr<Communicator>> shared_gpu_nccl(int n, const std::vector<Device>& devices,
                                                           const std::vector<Stream*>& streams, NcclOptions no) {
  // NVIDIA's own multi-rank tests on one GPU: no NVLink SHARP, and few CTAs a rank so that the
  // ranks' kernels fit on the GPU together. A value the user set is kept.
  setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 0);
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  setenv("NCCL_MAX_CTAS", "2", 0);
  log_info("parallel.devices: ", n, " replicas share GPUs (", devices_str(devices), "): ", nccl_version(),
           " with ranks sharing a GPU (NCCL_MULTI_RANK_GPU_ENABLE=", std::getenv("NCCL_MULTI_RANK_GPU_ENABLE"),
           ", NCCL_NVLS_ENABLE=", std::getenv("NCCL_NVLS_ENABLE"), ", NCCL_MAX_CTAS=", std::getenv("NCCL_MAX_CTAS"),
           "); this tests ordering, pairing and failure handling, not link speed");
  return make_nccl_communicators(devices, streams, no);
}

std::vector<std::unique_ptr<Communicator>> staged_gpu_communicators(int n, const GroupOptions& opts) {
  log_info("parallel.devices: ", n, " replicas share GPUs: collectives are staged through host memory (",
           nccl_version(), " is loaded; NCCL ranks sharing a GPU need NCCL 2.30 or later)");
  HostCommOptions co;
  co.timeout = opts.comm_timeout;
  std::vector<std::unique_ptr<Communicator>> out;
  for (auto& c : make_host_communicators(n, co)) out.push_back(make_staged_communicator(std::move(c)));
  return out;
}

// The second NCCL communicator per GPU for sync-BN, when this NCCL can order two (else none).
std::vector<std::unique_ptr<Communicator>> latency_lanes(const std::vector<Device>& devices,
                                                         const std::vector<Stream*>& streams, NcclOptions no) {
  if (!nccl_orders_communicators()) {
    log_warn(nccl_version(), " cannot order two communicators per GPU (NCCL_LAUNCH_ORDER_IMPLICIT needs 2.26+): "
             "sync-BN shares the gradient communicator and waits behind its buckets");
    return {};
  }
  no.high_priority = true;
  return make_nccl_communicators(devices, streams, no);
}

// Replica r's pool settings; replicas sharing a GPU share its fraction (or bytes).
PoolOptions pool_options_for(const std::vector<Device>& devices, size_t r, const GroupOptions& opts,
                             bool peers_map_buffers) {
  PoolOptions po = devices[r].kind == DeviceKind::cpu ? opts.cpu_pool : opts.cuda_pool;
  if (devices[r].kind == DeviceKind::cuda) {
    const auto sharing = std::count(devices.begin(), devices.end(), devices[r]);
    po.fraction /= static_cast<double>(sharing);
    po.bytes /= static_cast<size_t>(sharing);
  }
  // When every process of an MPI job is on this machine, the node all-reduce reads and writes
  // the process leaders' buffers in place if they lie in memory the other processes can map
  // (core/memory/shared_host_memory.h); REPLICA_MPI_ZERO_COPY=0 keeps private pages, and the
  // all-reduce copies through its window. Across machines there is no node all-reduce to serve.
  if (devices[r].kind == DeviceKind::cpu && peers_map_buffers && env_flag("REPLICA_MPI_ZERO_COPY", true))
    po.shared_across_processes = true;
  return po;
}
}  // namespace

ReplicaGroup::ReplicaGroup(const std::vector<Device>& devices, GroupOptions opts) : pin_(opts.pin_threads) {
  if (devices.empty()) throw ConfigError("parallel.devices: no devices given");
  int cuda_count = 0;
  for (auto& d : devices) cuda_count += d.kind == DeviceKind::cuda;
  if (cuda_count && cuda_count != static_cast<int>(devices.size()))
    throw ConfigError("parallel.devices: mixing CPU and GPU replicas in one group is not supported");
  // Streams first: NCCL orders its collectives after each replica's compute stream.
  std::vector<std::unique_ptr<Stream>> streams;
  std::vector<Stream*> stream_ptrs;
  for (auto& d : devices) {
    streams.push_back(make_stream(d));
    stream_ptrs.push_back(streams.back().get());
  }
  std::vector<std::unique_ptr<Communicator>> comms, lanes;
  const int n = static_cast<int>(devices.size());
  if (cuda_count == 1 && !launched_by_mpi() && opts.solo_single_gpu) {
    // One GPU, one process: nothing to communicate, so no NCCL (nor its start-up) is needed.
    comms.push_back(make_solo_communicator());
  } else if (cuda_count && shares_a_gpu(devices) && launched_by_mpi()) {
    throw ConfigError("parallel.devices: several replicas on one GPU work within one process only, not under MPI");
  } else if (cuda_count && shares_a_gpu(devices) && shared_gpu_over_nccl()) {
    NcclOptions no;
    no.timeout = opts.comm_timeout;
    comms = shared_gpu_nccl(n, devices, stream_ptrs, no);
    if (opts.latency_lane) lanes = latency_lanes(devices, stream_ptrs, no);
  } else if (cuda_count && shares_a_gpu(devices)) {
    comms = staged_gpu_communicators(n, opts);
  } else if (cuda_count) {
    NcclOptions no;
    no.timeout = opts.comm_timeout;
    comms = make_nccl_communicators(devices, stream_ptrs, no);
    if (opts.latency_lane && cuda_count > 1) lanes = latency_lanes(devices, stream_ptrs, no);
  } else if (launched_by_mpi()) {
    MpiCommOptions mo;
    mo.timeout = opts.comm_timeout;
    comms = make_mpi_communicators(n, mo);
  } else {
    HostCommOptions co;
    co.timeout = opts.comm_timeout;
    comms = make_host_communicators(n, co);
  }
  // A CPU replica's step can be recorded and replayed (train.cuda_graph's CPU form): its
  // collectives go into the recording as a GPU's NCCL calls go into its graph.
  if (!cuda_count)
    for (auto& c : comms) c = make_recordable_communicator(std::move(c));
  if (launched_by_mpi()) {
    auto p = mpi_process();
    process_rank_ = p.rank;
    processes_ = p.size;
    // Processes sharing a node take disjoint cores: the launcher says which one this is.
    node_slot_ = launcher_local_rank();
  }
  pin_ = pin_ && static_cast<int>(devices.size()) <= host_core_count();
  const bool peers_map_buffers = comms[0]->maps_peer_buffers();  // before the loop moves comms[0]
  for (size_t r = 0; r < devices.size(); ++r) {
    auto rep = std::make_unique<Replica>();
    rep->local_ = static_cast<int>(r);
    rep->rank_ = comms[r]->rank();
    rep->device_ = devices[r];
    rep->pool_ = make_pool(devices[r], pool_options_for(devices, r, opts, peers_map_buffers));
    rep->stream_ = std::move(streams[r]);
    if (devices[r].kind == DeviceKind::cuda) rep->copy_stream_ = make_stream(devices[r]);
    rep->comm_ = std::move(comms[r]);
    if (!lanes.empty()) rep->lane_ = std::move(lanes[r]);
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
    CPU_SET((node_slot_ * size() + r) % host_core_count(), &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort
  }
  // Kernels and copies of this thread go to the replica's device and compute stream.
  if (replicas_[r]->device_.kind == DeviceKind::cuda) cuda::set_device(replicas_[r]->device_.index);
  set_current_stream(replicas_[r]->stream_.get());
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
    } catch (const CommError& e) {
      // The communicator that failed has aborted itself; with a latency lane the other one of
      // the pair has not (NCCL aborts are idempotent, so both are told).
      err = std::current_exception();
      if (replicas_[r]->has_lane()) replicas_[r]->abort(e.what());
    } catch (const std::exception& e) {
      err = std::current_exception();
      replicas_[r]->abort("replica " + std::to_string(replicas_[r]->rank_) + " (" + replicas_[r]->device_.str() +
                          ") failed: " + e.what());
    } catch (...) {
      err = std::current_exception();
      replicas_[r]->abort("replica " + std::to_string(r) + " failed");
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
  own_failures_.clear();
  generation_++;
  cv_start_.notify_all();
  cv_done_.wait(lock, [&] { return running_ == 0; });
  if (error_order_.empty()) return;
  broken_ = true;
  // Report the replica whose own error started it: prefer a non-communication error.
  int who = -1;
  for (int r : error_order_) {
    try {
      std::rethrow_exception(errors_[r]);
    } catch (const CommError&) {
    } catch (...) {
      if (who < 0) who = r;
      own_failures_.push_back(replicas_[r]->rank_);
    }
  }
  if (who < 0) who = error_order_.front();
  try {
    std::rethrow_exception(errors_[who]);
  } catch (const std::exception& e) {
    const int global = replicas_[who]->rank_;
    throw ReplicaError(global,
                       "replica " + std::to_string(global) + " (" +
                           (processes_ > 1 ? "process " + std::to_string(process_rank_) + ", " : std::string()) +
                           replicas_[who]->device_.str() + "): " + e.what(),
                       errors_[who]);
  }
}

}  // namespace replica::parallel
