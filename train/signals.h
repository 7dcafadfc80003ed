// SIGTERM / SIGINT for `replica train`: the first signal asks the run to finish its current
// step, write a checkpoint and exit cleanly (spot-instance preemption); a second one exits at
// once. A signal is process-wide, so this is the one piece of global state in replica.
#pragma once

namespace replica::train {

void install_stop_signals();
bool stop_requested();
int stop_signal();  // the signal number received, 0 if none
// For tests and embedders: ask for a stop as a signal would.
void request_stop();
void clear_stop();

}  // namespace replica::train
