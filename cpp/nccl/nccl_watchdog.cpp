#include "nccl_watchdog.h"

#include <nccl.h>

#include <chrono>
#include <exception>
#include <memory>
#include <string>

#include "../cuda_guard.h"
#include "../poll.h"
#include "nccl_loader.h"

namespace compcomm::nccl {

bool capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(as_stream(stream), &status) != cudaSuccess) {
    cudaGetLastError();  // e.g. the legacy stream queried during another thread's capture
    return true;         // be conservative: never record/query events then
  }
  return status != cudaStreamCaptureStatusNone;
}

void NcclCommunicator::track_locked(void* stream, double timeout_s, const char* call) {
  // A world of one rank has no peer to wait for: nothing can hang, so no event is needed.
  if (size_ == 1 || !watchdog_.joinable() || capturing(stream)) return;
  cudaEvent_t ev;
  if (!free_events_.empty()) {
    ev = static_cast<cudaEvent_t>(free_events_.back());
    free_events_.pop_back();
  } else {
    check_cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), {"nccl", "watchdog", rank_});
  }
  const cudaError_t e = cudaEventRecord(ev, as_stream(stream));
  if (e != cudaSuccess) {
    free_events_.push_back(ev);
    check_cuda(e, {"nccl", "watchdog", rank_});
  }
  pending_.push_back(std::make_unique<Pending>(Pending{ev, now_s() + timeout_s, timeout_s, call}));
}

void NcclCommunicator::release_events_locked() {
  for (auto& p : pending_) free_events_.push_back(p->event);
  pending_.clear();
  for (void* ev : free_events_) cudaEventDestroy(static_cast<cudaEvent_t>(ev));
  free_events_.clear();
}

void NcclCommunicator::watchdog_loop() {
  // Queries from this thread must not invalidate a graph capture running on another thread.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  cudaSetDevice(device_);
  try {
    watchdog_poll();
  } catch (const std::exception& e) {  // never let an exception end the process from this thread
    std::lock_guard<std::mutex> lock(mu_);
    abort_locked(std::string("nccl watchdog failed: ") + e.what(), false);
  }
}

void NcclCommunicator::watchdog_poll() {
  while (!stop_.load()) {
    {
      std::unique_lock<std::mutex> wl(wd_mu_);
      wd_cv_.wait_for(wl, std::chrono::milliseconds(10));
    }
    if (stop_.load()) break;
    const double t = now_s();
    const double in_call = call_deadline_.load();
    if (in_call > 0 && t > in_call) {
      // The calling thread is stuck inside NCCL and holds mu_: abort from here. NCCL's abort flag
      // makes the stuck call return; the caller then finds the communicator closed.
      if (!abort_claimed_.exchange(true)) {
        QuietDeviceGuard guard(device_);
        raise_abort_flag();
        api().CommAbort(as_comm(live_comm_.load()));
      }
      break;
    }
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock()) continue;  // a call is running; look again at the next tick
    if (closed_) break;
    for (auto it = pending_.begin(); it != pending_.end();) {
      const cudaError_t q = cudaEventQuery((*it)->event);
      if (q == cudaSuccess) {
        free_events_.push_back((*it)->event);
        it = pending_.erase(it);
        continue;
      }
      if (q != cudaErrorNotReady) {
        abort_locked(detail::concat("[rank ", rank_, "] nccl: device error ", cudaGetErrorName(q),
                                    ": ", cudaGetErrorString(q), "; the communicator was aborted"),
                     false);
        break;
      }
      if (t > (*it)->deadline) {
        abort_locked(detail::concat("[rank ", rank_, "] nccl ", (*it)->call,
                                    " did not complete within its timeout of ", (*it)->timeout_s,
                                    " s (a peer died or never called it); the communicator "
                                    "was aborted"),
                     true);
        break;
      }
      ++it;
    }
    if (closed_) break;
    ncclResult_t st = ncclSuccess;
    if (api().CommGetAsyncError(as_comm(comm_), &st) == ncclSuccess && st != ncclSuccess &&
        st != ncclInProgress) {
      abort_locked(detail::concat("[rank ", rank_, "] nccl: asynchronous error: ",
                                  nccl_text(st, comm_), "; the communicator was aborted"),
                   false);
      break;
    }
  }
}

}  // namespace compcomm::nccl
