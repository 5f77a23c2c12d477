// How the MPI communicator's wait loops spend the time between two polls that found nothing new.
//
// Open MPI (and MPICH without an async progress thread) moves a non-blocking transfer forward only
// inside MPI calls: a loop that sleeps between MPI_Test calls while data is in flight stalls the
// transfer for the whole sleep (measured: a 4 MiB MPI_Ialltoall on shared memory several times
// slower than the blocking call). So the loop polls without pausing while a transfer may still be
// moving -- `spin_s` after the last progress, stretched by the time the outstanding bytes need at
// a pessimistic `slow_bytes_per_s` -- then polls with a yield (lets an oversubscribed peer run),
// and only after `yield_s` more without progress sleeps, doubling from `first_sleep_us` up to
// `max_sleep_us`: a dead or absent peer then costs little CPU and the deadline is still checked at
// least every max_sleep_us. Progress (a request or a copy finished) restarts the schedule.
//
// No MPI here: the policy is plain arithmetic on the caller's clock, so tests can drive it.
#pragma once

#include <algorithm>
#include <cstdint>

namespace compcomm {

struct BackoffPolicy {
  double spin_s = 200e-6;             // busy polling after progress, whatever the size
  double yield_s = 20e-3;             // then polling with sched_yield
  double slow_bytes_per_s = 0.25e9;   // a transfer of B bytes may take B / this without progress
  int first_sleep_us = 20;
  int max_sleep_us = 200;             // bounds the timeout's overshoot and a dead peer's poll rate
};

class Backoff {
 public:
  enum class Action { kSpin, kYield, kSleep };

  // `bytes` in flight (0 when unknown or small): widens the no-sleep window, see above.
  Backoff(const BackoffPolicy& policy, double now, int64_t bytes = 0)
      : p_(policy), last_(now), sleep_us_(policy.first_sleep_us) {
    active_s_ = p_.spin_s + static_cast<double>(std::max<int64_t>(bytes, 0)) / p_.slow_bytes_per_s;
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
    if (quiet < active_s_) return Action::kSpin;
    if (quiet < active_s_ + p_.yield_s) return Action::kYield;
    *sleep_us = sleep_us_;
    sleep_us_ = std::min(p_.max_sleep_us, sleep_us_ * 2);
    return Action::kSleep;
  }

  // Seconds without progress after which sleeping starts.
  double sleep_after_s() const { return active_s_ + p_.yield_s; }

 private:
  BackoffPolicy p_;
  double last_;
  double active_s_;
  int sleep_us_;
};

}  // namespace compcomm
