// CollectiveQueue: one rank's collectives in issue order. Async ones run on a worker thread (so
// they overlap the caller's compute) and return a Work handle; blocking ones run on the caller's
// thread once every async one issued before them is done (two thread hand-offs saved). The host
// and MPI communicators share it.
#pragma once
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "parallel/communicator.h"

namespace replica::parallel {

// A Work finished by whoever ran it.
class PendingWork : public Work {
 public:
  void wait() override {
    std::unique_lock<std::mutex> lock(m_);
    cv_.wait(lock, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
  bool done() override {
    std::lock_guard<std::mutex> lock(m_);
    return done_;
  }
  void finish(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(m_);
    done_ = true;
    error_ = e;
    cv_.notify_all();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

class CollectiveQueue {
 public:
  CollectiveQueue() : worker_([this] { loop(); }) {}
  ~CollectiveQueue() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  CollectiveQueue(const CollectiveQueue&) = delete;
  CollectiveQueue& operator=(const CollectiveQueue&) = delete;

  WorkHandle submit(std::function<void()> fn) {
    auto w = std::make_shared<PendingWork>();
    {
      std::lock_guard<std::mutex> lock(m_);
      queue_.emplace_back(std::move(fn), w);
    }
    cv_.notify_one();
    return w;
  }

  // Runs fn on this thread after the async collectives issued before it (directly when called
  // from the worker itself).
  template <typename F>
  void run_here(F&& fn) {
    if (std::this_thread::get_id() != worker_.get_id()) {
      std::unique_lock<std::mutex> lock(m_);
      idle_.wait(lock, [&] { return queue_.empty() && !busy_; });
    }
    fn();
  }

 private:
  void loop() {
    for (;;) {
      std::pair<std::function<void()>, std::shared_ptr<PendingWork>> item;
      {
        std::unique_lock<std::mutex> lock(m_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
      }
      std::exception_ptr err;
      try {
        item.first();
      } catch (...) {
        err = std::current_exception();
      }
      item.second->finish(err);
      std::lock_guard<std::mutex> lock(m_);
      busy_ = false;
      if (queue_.empty()) idle_.notify_all();
    }
  }

  std::mutex m_;
  std::condition_variable cv_, idle_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<PendingWork>>> queue_;
  bool stop_ = false, busy_ = false;
  std::thread worker_;  // last: starts after the queue exists
};

}  // namespace replica::parallel
