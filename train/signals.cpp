// Async-signal-safe stop flag.
#include "train/signals.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>

namespace replica::train {

namespace {
std::atomic<int> g_signal{0};
std::atomic<int> g_count{0};

void on_signal(int sig) {
  if (g_count.fetch_add(1) >= 1) {
    static const char msg[] = "\nreplica: second signal, exiting now without a checkpoint\n";
    ssize_t ignored = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)ignored;
    _exit(128 + sig);
  }
  g_signal.store(sig);
}
}  // namespace

void install_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

bool stop_requested() { return g_signal.load() != 0; }
int stop_signal() { return g_signal.load(); }
void request_stop() { g_signal.store(SIGTERM); }
void clear_stop() {
  g_signal.store(0);
  g_count.store(0);
}

}  // namespace replica::train
