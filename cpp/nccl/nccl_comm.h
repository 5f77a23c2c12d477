// NcclCommunicator: the Communicator interface over an ncclComm_t, for CUDA device buffers.
//
// How it works. libnccl.so.2 is never linked: the first use dlopen()s it (the copy torch already
// loaded if there is one, else the candidates given by the caller, else the system's) and resolves
// the few functions used here into a table, so the package builds and imports on machines without
// NCCL. Every collective is enqueued on the caller's stream (CallOptions::stream) and returns
// without waiting for the device, so a CUDA graph can capture it.
//
// Faults. A watchdog thread enforces each call's timeout. Device side (a peer that never joins a
// collective, so the kernel spins): after each collective that is not being captured into a graph,
// an event is recorded on the stream with the call's deadline; if it has not completed by then, or
// NCCL reports an asynchronous error, the watchdog aborts the communicator (ncclCommAbort, which
// also releases the spinning kernels). Host side (a call stuck inside NCCL, e.g. connection setup
// with a peer that never calls): the watchdog sees the call outlive its deadline and aborts too;
// NCCL's abort flag makes the call return. Every later call raises the stored error (TimeoutError
// or BackendError): an aborted communicator is never used again. Released kernels end without
// their data, but the caller's stream goes on to run what was enqueued behind them (the commit of a
// compressed allreduce): every abort first sets this communicator's abort flag
// (Communicator::abort_flag, mapped host memory), which that commit reads before it writes.
//
// Blocking mode (the default) launches in the caller's thread. Non-blocking mode
// (ncclConfig_t::blocking = 0) is available: NCCL then launches every group from a new thread and
// the call polls ncclCommGetAsyncError until done or its deadline -- robust, but tens of
// microseconds slower per call.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../comm.h"

namespace compcomm::nccl {

constexpr int kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES

// Loads libnccl.so.2 (once per process) and returns the path of the library in use. Order: the file
// named by $COMPCOMM_NCCL_LIBRARY; a libnccl.so.2 already loaded in the process (torch's); each of
// `candidates`; the dynamic linker's search for "libnccl.so.2". Throws Unsupported listing what was
// tried when none loads or the library lacks a needed function.
std::string load(const std::vector<std::string>& candidates = {});
// True once load() has succeeded.
bool loaded();
// The runtime library's version code (e.g. 22809 for 2.28.9); loads the library if needed.
int runtime_version();
// A fresh ncclUniqueId as kUniqueIdBytes raw bytes (what rank 0 creates and shares).
std::string unique_id();

class NcclCommunicator final : public Communicator {
 public:
  // Joins the communicator `unique_id` (from unique_id() on one rank, shared with all) as `rank` of
  // `size`, on CUDA device `device`. Waits at most `timeout_s` for the other ranks. `blocking`
  // selects a blocking NCCL communicator (no host-side timeout on NCCL calls); `watchdog` enables
  // the device-side timeout thread.
  NcclCommunicator(const std::string& unique_id, int rank, int size, int device,
                   double timeout_s = 600.0, bool blocking = true, bool watchdog = true);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend_name() const override { return "nccl"; }
  int device() const { return device_; }
  bool blocking() const { return blocking_; }

  // Finalizes and frees the NCCL communicator (waits at most timeout_s for pending work, then
  // aborts). Later calls raise. Idempotent.
  void destroy(double timeout_s = 30.0);
  // Aborts the NCCL communicator now (pending device work is cancelled). Later calls raise.
  void abort(const std::string& reason = "aborted by the user");
  // True after abort() or destroy(), or once the watchdog has aborted the communicator.
  bool closed() const;
  // Why the communicator is closed ("" while it is open).
  std::string closed_reason() const;
  // Blocks until the device work of the collectives this communicator enqueued (outside graph
  // capture) has finished, at most timeout_s; on timeout aborts and raises TimeoutError. A world of
  // one rank tracks nothing (no peer can make it hang), so this returns at once there.
  void synchronize(double timeout_s);

 protected:
  void do_all_to_all(const Buffer& send, const Buffer& recv, const CallOptions& opts) override;
  void do_all_gather(const Buffer& send, const Buffer& recv, const CallOptions& opts) override;
  void do_reduce_scatter(const Buffer& send, const Buffer& recv, ReduceOp op,
                         const CallOptions& opts) override;
  void do_all_reduce(const Buffer& buf, ReduceOp op, const CallOptions& opts) override;
  void do_broadcast(const Buffer& buf, int root, const CallOptions& opts) override;
  void do_barrier(const CallOptions& opts) override;
  // Throws (TimeoutError or BackendError, with the reason) if the communicator is closed.
  void do_check_open(const char* call) override;
  // The flag raise_abort_flag() sets (nullptr if mapped host memory was unavailable).
  const int* do_abort_flag() const override { return abort_flag_dev_; }
  // One rank: NCCL's collectives are copies on the stream, untracked by the watchdog (no peer);
  // buffers elsewhere than on device_ would be refused, so those calls still go to NCCL.
  bool do_alone(int device) const override { return device == device_; }

 private:
  struct Pending;  // an event recorded after a collective, with its deadline (nccl_watchdog.h)
  class Call;  // guard for one collective: device, liveness check, error mapping, watchdog event

  void* comm_ = nullptr;                    // ncclComm_t; written under mu_
  std::atomic<void*> live_comm_{nullptr};   // comm_, for the watchdog's abort of a stuck call
  std::atomic<bool> abort_claimed_{false};  // set by whoever frees comm_ (abort or destroy), once
  std::atomic<double> call_deadline_{0.0};  // deadline of the call inside NCCL now (blocking mode)
  int rank_, size_, device_;
  bool blocking_;
  int* barrier_word_ = nullptr;  // 1 int of device memory for barrier()
  // The abort flag (Communicator::abort_flag): one int of mapped pinned host memory,
  // its host and device addresses; never freed (see new_abort_flag in nccl_comm.cpp).
  int* abort_flag_ = nullptr;
  const int* abort_flag_dev_ = nullptr;

  mutable std::mutex mu_;  // guards comm_ use against the watchdog's abort, and the fields below
  bool closed_ = false;
  bool timed_out_ = false;
  std::string closed_reason_;
  std::deque<std::unique_ptr<Pending>> pending_;
  std::vector<void*> free_events_;  // cudaEvent_t pool

  std::thread watchdog_;
  std::mutex wd_mu_;
  std::condition_variable wd_cv_;
  std::atomic<bool> stop_{false};

  void watchdog_loop();
  void watchdog_poll();
  // Sets the abort flag; called before every ncclCommAbort, so that a commit gate queued
  // behind the kernels the abort releases already sees it.
  void raise_abort_flag();
  // With mu_ held: aborts comm_ and records why. Returns false if it was already closed.
  bool abort_locked(const std::string& reason, bool timed_out);
  [[noreturn]] void throw_closed_locked(const char* call) const;
  // With mu_ held: if the watchdog aborted comm_ during a stuck call, record that it is closed.
  void absorb_watchdog_abort_locked(const char* call);
  // With mu_ held: checks an NCCL return code, polling ncclInProgress until `deadline_s` (steady
  // clock seconds). Throws BackendError/TimeoutError (aborting on timeout).
  void check_locked(int result, const char* call, double deadline_s);
  void track_locked(void* stream, double timeout_s, const char* call);
  void release_events_locked();
};

}  // namespace compcomm::nccl
