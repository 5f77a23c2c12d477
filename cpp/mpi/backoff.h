// How the MPI communicator's wait loops spend the time between two polls that found nothing new.
//
// Open MPI (and MPICH without an async progress thread) moves a non-blocking transfer forward only
// inside MPI calls: a loop that sleeps between MPI_Test calls while data is in flight stalls the
// transfer at every protocol step (rendezvous handshake, each fragment) for up to a whole sleep. So
// after progress the loop polls flat out for `spin_s`, then polls with a yield (no latency when the
// core is free, and an oversubscribed peer gets to run) for as long as a transfer may still be
// moving -- `yield_s`, stretched by the time the bytes in flight need at a pessimistic
// `slow_bytes_per_s` -- and only then sleeps, doubling from `first_sleep_us` up to `max_sleep_us`:
// a dead or absent peer costs little CPU and the deadline is still checked that often. Progress (a
// request or a copy finished) restarts the schedule.
//
// More ranks on the node than cores it may use (3 ranks on 2 cores: tests, CI) turns this around: the
// peer we wait for needs our core to make progress at all, so polling is short and sleeping early is
// the better choice (one noisy run on a loaded 2-core machine, 3 ranks: the compressed allreduce up to
// 2x slower with the busy policy). oversubscribed() is that policy.
//
// No MPI here: the policy is plain arithmetic on the caller's clock, so tests can drive it; pause()
// and poll_until() below act on it through the wait loop shared with the NCCL backend (../poll.h).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>

#include "../poll.h"

namespace compcomm {

struct BackoffPolicy {
  double spin_s = 200e-6;            // busy polling after progress
  double yield_s = 20e-3;            // then polling with sched_yield, plus the bytes' time below
  double slow_bytes_per_s = 0.25e9;  // a transfer of B bytes may take B / this without progress
  int first_sleep_us = 20;
  int max_sleep_us = 200;            // bounds the timeout's overshoot and a dead peer's poll rate

  static BackoffPolicy oversubscribed() {
    BackoffPolicy p;
    p.spin_s = 20e-6;
    p.yield_s = 150e-6;  // a yielding poller still keeps the descheduled peer off the core
    p.slow_bytes_per_s = 1e30;  // no window for the bytes: the sleeper's core moves them
    return p;
  }
};

class Backoff {
 public:
  enum class Action { kSpin, kYield, kSleep };

  // `bytes` in flight (0 when unknown or small) widen the no-sleep window, see above.
  Backoff(const BackoffPolicy& policy, double now, int64_t bytes = 0)
      : p_(policy), last_(now), sleep_us_(policy.first_sleep_us) {
    const double moving_s = static_cast<double>(std::max<int64_t>(bytes, 0)) / p_.slow_bytes_per_s;
    sleep_after_s_ = p_.spin_s + p_.yield_s + moving_s;
  }

  // After a poll that finished something: back to spinning.
  void progressed(double now) {
    last_ = now;
    sleep_us_ = p_.first_sleep_us;
  }

  // After a poll that finished nothing: what to do before the next poll. For kSleep, *sleep_us is
  // how long (grows by doubling across consecutive calls, capped at max_sleep_us).
  Action idle(double now, int* sleep_us) {
    const double quiet = now - last_;
    if (quiet < p_.spin_s) return Action::kSpin;
    if (quiet < sleep_after_s_) return Action::kYield;
    *sleep_us = sleep_us_;
    sleep_us_ = std::min(p_.max_sleep_us, sleep_us_ * 2);
    return Action::kSleep;
  }

  // The pacer step of poll_until (../poll.h): idle(), then what it says.
  void pause(double now) {
    int us = 0;
    switch (idle(now, &us)) {
      case Action::kSpin: break;
      case Action::kYield: std::this_thread::yield(); break;
      case Action::kSleep: std::this_thread::sleep_for(std::chrono::microseconds(us)); break;
    }
  }

  // Seconds without progress after which sleeping starts.
  double sleep_after_s() const { return sleep_after_s_; }

 private:
  BackoffPolicy p_;
  double last_;
  double sleep_after_s_;
  int sleep_us_;
};

// Calls `poll(&progress)` until it returns true (done), pausing between polls as Backoff says (no
// sleeping while `bytes` may still be moving). Past the deadline, calls on_timeout, which throws.
template <class Poll, class OnTimeout>
void poll_until(const BackoffPolicy& policy, double deadline, int64_t bytes, Poll&& poll,
                OnTimeout&& on_timeout) {
  Backoff backoff(policy, now_s(), bytes);
  poll_until(backoff, deadline, poll, on_timeout);
}

}  // namespace compcomm
