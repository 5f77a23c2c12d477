// The wait loop shared by the backends: poll, check the deadline, pause as a pacing policy says.
//
// A pacer has two members: progressed(now), after a poll that finished something, and pause(now),
// after one that finished nothing (it spins, yields or sleeps). Two policies exist: the MPI wait
// loops' time-based Backoff (cpp/mpi/backoff.h: no sleeping while bytes may be moving, because Open
// MPI moves a transfer only inside MPI calls) and CountingBackoff below (NCCL's: its progress is
// made by the device and NCCL's own threads, so only latency and CPU use matter). No MPI, NCCL or
// CUDA here.
#pragma once

#include <chrono>
#include <thread>

namespace compcomm {

// Seconds on the steady clock: the time base of every deadline.
inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Calls `poll(&progress)` until it returns true (done). Past `deadline` calls `on_timeout`, which
// throws. Between polls asks `pacer` to pause, or tells it of progress when the poll set it.
template <class Pacer, class Poll, class OnTimeout>
void poll_until(Pacer& pacer, double deadline, Poll&& poll, OnTimeout&& on_timeout) {
  for (;;) {
    bool progress = false;
    if (poll(&progress)) return;
    const double t = now_s();
    if (t > deadline) on_timeout();
    if (progress) {
      pacer.progressed(t);
      continue;
    }
    pacer.pause(t);
  }
}

// Pacing by poll count (the NCCL communicator's): yield for the first 2000 pauses (low latency for
// short waits), then sleep 20 us, and 500 us from the 20000th on. Progress does not reset it.
class CountingBackoff {
 public:
  void progressed(double) {}
  void pause(double = 0.0) {
    if (++spins_ < 2000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(spins_ < 20000 ? 20 : 500));
    }
  }

 private:
  int spins_ = 0;
};

}  // namespace compcomm
