// SpinLock: the memory pool's lock. The pool's critical sections are ~100 ns and almost never
// contended (one replica thread per pool), where std::mutex costs two atomic read-modify-writes
// and two calls per lock/unlock; this one is one exchange to take it and a plain store to give
// it back (measured: 15-20 ns of a 140 ns alloc+free pair, bench/RESULTS.md). A waiter spins
// briefly, then yields, then sleeps in 50 us steps, so a holder that waits (a GPU event) or is
// descheduled does not cost a core for long. Not recursive; BasicLockable (std::lock_guard).
#pragma once
#include <atomic>
#include <chrono>
#include <thread>

namespace replica::detail {

class SpinLock {
 public:
  void lock() {
    if (!held_.exchange(true, std::memory_order_acquire)) return;
    wait();
  }
  bool try_lock() { return !held_.load(std::memory_order_relaxed) && !held_.exchange(true, std::memory_order_acquire); }
  void unlock() { held_.store(false, std::memory_order_release); }

 private:
  void wait() {
    for (int spins = 0;;) {
      while (held_.load(std::memory_order_relaxed)) {
        if (spins < 128) pause();
        else if (spins < 160) std::this_thread::yield();
        else std::this_thread::sleep_for(std::chrono::microseconds(50));
        ++spins;
      }
      if (!held_.exchange(true, std::memory_order_acquire)) return;
    }
  }
  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
  std::atomic<bool> held_{false};
};

}  // namespace replica::detail
