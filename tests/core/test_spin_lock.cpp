// SpinLock, the memory pool's lock: mutual exclusion under contention, try_lock, and a waiter
// that gets in after a holder that sleeps (past the spinning and yielding phases). Also run under
// ThreadSanitizer (scripts/setup.sh), which checks its acquire/release ordering.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "core/spin_lock.h"

using replica::detail::SpinLock;

TEST(SpinLock, ExcludesUnderContention) {
  SpinLock lock;
  long counter = 0;  // not atomic: only the lock protects it
  std::atomic<int> inside{0}, most_inside{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 50000; ++i) {
        std::lock_guard<SpinLock> g(lock);
        const int now = inside.fetch_add(1) + 1;
        int seen = most_inside.load();
        while (now > seen && !most_inside.compare_exchange_weak(seen, now)) {
        }
        ++counter;
        inside.fetch_sub(1);
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(counter, 4 * 50000);
  EXPECT_EQ(most_inside.load(), 1);
}

TEST(SpinLock, AWaiterGetsInAfterAHolderThatSleeps) {
  SpinLock lock;
  lock.lock();
  EXPECT_FALSE(lock.try_lock());
  std::atomic<bool> got{false};
  std::thread waiter([&] {
    std::lock_guard<SpinLock> g(lock);
    got = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));  // the waiter is sleeping in steps by now
  EXPECT_FALSE(got.load());
  lock.unlock();
  waiter.join();
  EXPECT_TRUE(got.load());
  EXPECT_TRUE(lock.try_lock());
  lock.unlock();
}
