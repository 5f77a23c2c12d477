#include "nccl_comm.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>

#include "../cuda_guard.h"
#include "../poll.h"
#include "nccl_loader.h"
#include "nccl_watchdog.h"

namespace compcomm::nccl {

namespace {

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kUInt8:
      return ncclUint8;
    case DType::kInt32:
      return ncclInt32;
    case DType::kInt64:
      return ncclInt64;
    case DType::kFloat64:
      return ncclFloat64;
  }
  throw InvalidArgument("nccl: unsupported dtype");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  throw InvalidArgument("nccl: unsupported reduce op");
}

// Device abort flags: one int per communicator in mapped pinned host memory, so the host sets it
// with a plain store while kernels spin, and a kernel reads it without any copy. Slots come from
// slabs that are never freed and never reused: a commit gate still queued on some stream may read
// its communicator's flag after that communicator is gone, and then reads that flag, not another's.
struct AbortFlag {
  int* host = nullptr;
  const int* device = nullptr;
};

AbortFlag new_abort_flag() {
  constexpr int kSlots = 1024;
  static std::mutex mu;
  static int* slab = nullptr;
  static int* slab_device = nullptr;
  static int used = kSlots;
  std::lock_guard<std::mutex> lock(mu);
  if (used == kSlots) {
    void* host = nullptr;
    void* device = nullptr;
    if (cudaHostAlloc(&host, kSlots * sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable) !=
        cudaSuccess) {
      cudaGetLastError();
      return {};  // no gate: the commit then behaves as before this flag existed
    }
    if (cudaHostGetDevicePointer(&device, host, 0) != cudaSuccess) {
      cudaGetLastError();
      cudaFreeHost(host);
      return {};
    }
    std::memset(host, 0, kSlots * sizeof(int));
    slab = static_cast<int*>(host);
    slab_device = static_cast<int*>(device);
    used = 0;
  }
  const int i = used++;
  return {slab + i, slab_device + i};
}

}  // namespace

// One collective: holds the lock (so the watchdog cannot abort mid-call), checks the communicator
// is open and the buffers are on its device, makes the device current, and after the NCCL calls
// registers the completion event with the watchdog.
class NcclCommunicator::Call {
 public:
  Call(NcclCommunicator& c, const char* name, const CallOptions& opts)
      : c_(c),
        name_(name),
        opts_(opts),
        lock_(c.mu_),
        deadline_(now_s() + opts.timeout_s),
        device_(c.device_, {"nccl", name, c.rank_}) {
    c_.absorb_watchdog_abort_locked(name_);
    if (c_.closed_) c_.throw_closed_locked(name_);
    if (c_.blocking_) c_.call_deadline_.store(deadline_);
  }
  ~Call() { c_.call_deadline_.store(0.0); }
  void buffer(const Buffer& b, const char* arg) const {
    if (b.on_host())
      throw InvalidArgument(detail::concat(
          "[rank ", c_.rank_, "] nccl ", name_, ": '", arg,
          "' is host memory; the NCCL communicator needs CUDA buffers on cuda:", c_.device_));
    if (b.device != c_.device_)
      throw InvalidArgument(detail::concat("[rank ", c_.rank_, "] nccl ", name_, ": '", arg,
                                           "' is on cuda:", b.device,
                                           " but the communicator is on cuda:", c_.device_));
  }
  ncclComm_t comm() const { return as_comm(c_.comm_); }
  cudaStream_t stream() const { return as_stream(opts_.stream); }
  void check(int result) { c_.check_locked(result, name_, deadline_); }
  void cuda(cudaError_t e) const { check_cuda(e, {"nccl", name_, c_.rank_}); }
  void done() { c_.track_locked(opts_.stream, opts_.timeout_s, name_); }
  double deadline() const { return deadline_; }

 private:
  NcclCommunicator& c_;
  const char* name_;
  const CallOptions& opts_;
  std::unique_lock<std::mutex> lock_;
  double deadline_;
  DeviceGuard device_;
};

NcclCommunicator::NcclCommunicator(const std::string& id_bytes, int rank, int size, int device,
                                   double timeout_s, bool blocking, bool watchdog)
    : rank_(rank), size_(size), device_(device), blocking_(blocking) {
  COMPCOMM_CHECK(id_bytes.size() == static_cast<size_t>(kUniqueIdBytes),
                 "NcclCommunicator: unique_id must be ", kUniqueIdBytes,
                 " bytes (from nccl.unique_id()), got ", id_bytes.size());
  COMPCOMM_CHECK(size >= 1, "NcclCommunicator: size must be >= 1, got ", size);
  COMPCOMM_CHECK(device >= 0, "NcclCommunicator: device must be a CUDA device index >= 0, got ",
                 device);
  COMPCOMM_CHECK(timeout_s > 0, "NcclCommunicator: timeout_s must be positive, got ", timeout_s);
  const Api& a = api();
  DeviceGuard guard(device, {"nccl", "init", rank});

  ncclUniqueId id;
  std::memcpy(id.internal, id_bytes.data(), kUniqueIdBytes);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = blocking ? 1 : 0;
  ncclComm_t c = nullptr;
  ncclResult_t r = a.CommInitRankConfig(&c, size, id, rank, &config);
  const double deadline = now_s() + timeout_s;
  if (c && !blocking && (r == ncclSuccess || r == ncclInProgress)) {
    CountingBackoff pacer;
    poll_until(
        pacer, deadline,
        [&](bool*) {
          ncclResult_t st = ncclSuccess;
          const ncclResult_t q = a.CommGetAsyncError(c, &st);
          r = q != ncclSuccess ? q : st;
          return r != ncclInProgress;
        },
        [&] {
          a.CommAbort(c);
          throw TimeoutError(detail::concat("[rank ", rank, "] nccl init: the ", size,
                                            " ranks did not all join within ", timeout_s,
                                            " s; the communicator was aborted"),
                             "init", "nccl", ncclInProgress, rank);
        });
  }
  if (r != ncclSuccess) {
    const std::string text = nccl_text(r, c);
    if (c) a.CommAbort(c);
    throw BackendError(detail::concat("[rank ", rank, "] nccl init (rank ", rank, " of ", size,
                                      " on cuda:", device, ") failed: ", text),
                       "init", "nccl", r, rank);
  }
  comm_ = c;
  live_comm_.store(c);
  const cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&barrier_word_), sizeof(int));
  if (e != cudaSuccess) {
    a.CommAbort(c);
    comm_ = nullptr;
    live_comm_.store(nullptr);
    check_cuda(e, {"nccl", "init", rank});
  }
  const AbortFlag flag = new_abort_flag();
  abort_flag_ = flag.host;
  abort_flag_dev_ = flag.device;
  if (watchdog) watchdog_ = std::thread(&NcclCommunicator::watchdog_loop, this);
}

void NcclCommunicator::raise_abort_flag() {
  if (abort_flag_ == nullptr) return;
  *static_cast<volatile int*>(abort_flag_) = 1;
  std::atomic_thread_fence(std::memory_order_seq_cst);  // visible before ncclCommAbort starts
}

NcclCommunicator::~NcclCommunicator() {
  try {
    destroy(10.0);
  } catch (...) {  // a destructor must not throw; destroy() already aborted on failure
  }
}

bool NcclCommunicator::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

std::string NcclCommunicator::closed_reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_reason_;
}

void NcclCommunicator::throw_closed_locked(const char* call) const {
  const std::string msg =
      detail::concat("[rank ", rank_, "] nccl ", call, ": the communicator is closed (",
                     closed_reason_, "); create a new one");
  if (timed_out_) throw TimeoutError(msg, call, "nccl", 0, rank_);
  throw BackendError(msg, call, "nccl", 0, rank_);
}

bool NcclCommunicator::abort_locked(const std::string& reason, bool timed_out) {
  if (closed_) return false;
  closed_ = true;
  timed_out_ = timed_out;
  closed_reason_ = reason;
  if (comm_ && !abort_claimed_.exchange(true)) {
    QuietDeviceGuard guard(device_);
    raise_abort_flag();
    api().CommAbort(as_comm(comm_));  // also frees comm_; its result cannot be queried afterwards
  }
  comm_ = nullptr;
  live_comm_.store(nullptr);
  wd_cv_.notify_all();
  return true;
}

void NcclCommunicator::absorb_watchdog_abort_locked(const char* call) {
  if (closed_ || !abort_claimed_.load()) return;
  closed_ = true;
  timed_out_ = true;
  closed_reason_ =
      detail::concat("[rank ", rank_, "] nccl ", call,
                     ": a call was stuck inside NCCL past its timeout (a peer never joined); the "
                     "watchdog aborted the communicator");
  comm_ = nullptr;
  live_comm_.store(nullptr);
}

void NcclCommunicator::check_locked(int result, const char* call, double deadline_s) {
  absorb_watchdog_abort_locked(call);
  if (closed_) throw_closed_locked(call);
  const Api& a = api();
  if (result == ncclInProgress) {  // non-blocking mode: wait for NCCL to finish the host side
    CountingBackoff pacer;
    poll_until(
        pacer, deadline_s,
        [&](bool*) {
          ncclResult_t st = ncclSuccess;
          const ncclResult_t q = a.CommGetAsyncError(as_comm(comm_), &st);
          result = q != ncclSuccess ? q : st;
          return result != ncclInProgress;
        },
        [&] {
          const std::string msg =
              detail::concat("[rank ", rank_, "] nccl ", call,
                             " timed out: the peers did not answer; the communicator was aborted");
          abort_locked(msg, true);
          throw TimeoutError(msg, call, "nccl", ncclInProgress, rank_);
        });
  }
  if (result == ncclSuccess) return;
  const std::string msg =
      detail::concat("[rank ", rank_, "] nccl ", call, " failed: ", nccl_text(result, comm_));
  // A rejected argument leaves the communicator usable; any other failure leaves it in an unknown
  // state, so it is aborted rather than used again.
  if (result != ncclInvalidArgument && result != ncclInvalidUsage) abort_locked(msg, false);
  throw BackendError(msg, call, "nccl", result, rank_);
}

void NcclCommunicator::do_check_open(const char* call) {
  std::lock_guard<std::mutex> lock(mu_);
  absorb_watchdog_abort_locked(call);
  if (closed_) throw_closed_locked(call);
}

void NcclCommunicator::synchronize(double timeout_s) {
  const double deadline = now_s() + timeout_s;
  std::vector<cudaEvent_t> events;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) throw_closed_locked("synchronize");
    for (auto& p : pending_) events.push_back(p->event);
  }
  // Events stay valid while pending or pooled; they are destroyed only by destroy(), which this
  // object's owner does not call concurrently with synchronize().
  for (cudaEvent_t ev : events) {
    CountingBackoff pacer;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (closed_) throw_closed_locked("synchronize");
        const cudaError_t q = cudaEventQuery(ev);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) check_cuda(q, {"nccl", "synchronize", rank_});
        if (now_s() > deadline) {
          const std::string msg = detail::concat("[rank ", rank_,
                                                 "] nccl synchronize: device work did not finish "
                                                 "within ",
                                                 timeout_s, " s; the communicator was aborted");
          abort_locked(msg, true);
          throw TimeoutError(msg, "synchronize", "nccl", 0, rank_);
        }
      }
      pacer.pause();
    }
  }
}

void NcclCommunicator::destroy(double timeout_s) {
  stop_.store(true);
  {
    std::lock_guard<std::mutex> wl(wd_mu_);
    wd_cv_.notify_all();
  }
  if (watchdog_.joinable()) watchdog_.join();
  std::lock_guard<std::mutex> lock(mu_);
  absorb_watchdog_abort_locked("destroy");
  if (comm_ && !closed_ && !abort_claimed_.exchange(true)) {
    QuietDeviceGuard guard(device_);
    const Api& a = api();
    const double deadline = now_s() + timeout_s;
    bool ok = true;
    CountingBackoff pacer;  // one schedule for both waits below
    for (auto& p : pending_) {  // let tracked device work finish first (a dead peer: abort instead)
      cudaError_t q;
      while ((q = cudaEventQuery(p->event)) == cudaErrorNotReady && now_s() < deadline)
        pacer.pause();
      ok = ok && q == cudaSuccess;
    }
    ncclResult_t r = ok ? a.CommFinalize(as_comm(comm_)) : ncclInternalError;
    while (ok && r == ncclInProgress) {
      if (a.CommGetAsyncError(as_comm(comm_), &r) != ncclSuccess) r = ncclInternalError;
      if (r == ncclInProgress && now_s() > deadline) break;
      pacer.pause();
    }
    if (ok && r == ncclSuccess) {
      a.CommDestroy(as_comm(comm_));
    } else {
      raise_abort_flag();  // pending work is cancelled: its commits must not run
      a.CommAbort(as_comm(comm_));
    }
  }
  comm_ = nullptr;
  live_comm_.store(nullptr);
  if (!closed_) {
    closed_ = true;
    closed_reason_ = "destroyed";
  }
  release_events_locked();
  if (barrier_word_) {
    cudaFree(barrier_word_);
    barrier_word_ = nullptr;
  }
}

void NcclCommunicator::abort(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  abort_locked(reason, false);
}

void NcclCommunicator::do_all_to_all(const Buffer& send, const Buffer& recv,
                                     const CallOptions& opts) {
  Call call(*this, "all_to_all", opts);
  call.buffer(send, "send");
  call.buffer(recv, "recv");
  const size_t b = static_cast<size_t>(send.bytes() / size_);
  if (b == 0) return;
  const char* s = static_cast<const char*>(send.data);
  char* d = static_cast<char*>(recv.data);
  COMPCOMM_CHECK(size_ == 1 || d + b * size_ <= s || s + b * size_ <= d, "[rank ", rank_,
                 "] nccl all_to_all: send and recv must not overlap");
  // This rank's own chunk is a device copy; the others go through one group of sends and receives.
  if (s != d)
    call.cuda(
        cudaMemcpyAsync(d + b * rank_, s + b * rank_, b, cudaMemcpyDeviceToDevice, call.stream()));
  if (size_ > 1) {
    const Api& a = api();
    ncclResult_t r = a.GroupStart();
    for (int p = 0; p < size_ && r == ncclSuccess; ++p) {
      if (p == rank_) continue;
      r = a.Send(s + b * p, b, ncclUint8, p, call.comm(), call.stream());
      if (r == ncclSuccess) r = a.Recv(d + b * p, b, ncclUint8, p, call.comm(), call.stream());
    }
    const ncclResult_t end = a.GroupEnd();
    call.check(r != ncclSuccess ? r : end);
  }
  call.done();
}

void NcclCommunicator::do_all_gather(const Buffer& send, const Buffer& recv,
                                     const CallOptions& opts) {
  Call call(*this, "all_gather", opts);
  call.buffer(send, "send");
  call.buffer(recv, "recv");
  if (send.bytes() == 0) return;
  call.check(api().AllGather(send.data, recv.data, static_cast<size_t>(send.bytes()), ncclUint8,
                             call.comm(), call.stream()));
  call.done();
}

void NcclCommunicator::do_reduce_scatter(const Buffer& send, const Buffer& recv, ReduceOp op,
                                         const CallOptions& opts) {
  Call call(*this, "reduce_scatter", opts);
  call.buffer(send, "send");
  call.buffer(recv, "recv");
  if (recv.count == 0) return;
  call.check(api().ReduceScatter(send.data, recv.data, static_cast<size_t>(recv.count),
                                 nccl_type(recv.dtype), nccl_op(op), call.comm(), call.stream()));
  call.done();
}

void NcclCommunicator::do_all_reduce(const Buffer& buf, ReduceOp op, const CallOptions& opts) {
  Call call(*this, "all_reduce", opts);
  call.buffer(buf, "buf");
  if (buf.count == 0) return;
  call.check(api().AllReduce(buf.data, buf.data, static_cast<size_t>(buf.count),
                             nccl_type(buf.dtype), nccl_op(op), call.comm(), call.stream()));
  call.done();
}

void NcclCommunicator::do_broadcast(const Buffer& buf, int root, const CallOptions& opts) {
  Call call(*this, "broadcast", opts);
  call.buffer(buf, "buf");
  if (buf.bytes() == 0) return;
  call.check(api().Broadcast(buf.data, buf.data, static_cast<size_t>(buf.bytes()), ncclUint8, root,
                             call.comm(), call.stream()));
  call.done();
}

void NcclCommunicator::do_barrier(const CallOptions& opts) {
  // A one-word all_reduce, then (outside graph capture) a bounded wait for it on the host.
  double deadline;
  cudaEvent_t ev = nullptr;
  {
    Call call(*this, "barrier", opts);
    deadline = call.deadline();
    call.check(api().AllReduce(barrier_word_, barrier_word_, 1, ncclInt32, ncclSum, call.comm(),
                               call.stream()));
    if (capturing(opts.stream)) return;
    call.cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    const cudaError_t e = cudaEventRecord(ev, call.stream());
    if (e != cudaSuccess) cudaEventDestroy(ev);
    call.cuda(e);
    call.done();
  }
  CountingBackoff pacer;
  for (;;) {
    std::unique_lock<std::mutex> lock(mu_);
    const cudaError_t q = cudaEventQuery(ev);
    // Closed first: an abort releases NCCL's kernels, so the event of a barrier that never
    // completed fires too.
    absorb_watchdog_abort_locked("barrier");
    if (closed_) {
      cudaEventDestroy(ev);
      throw_closed_locked("barrier");
    }
    if (q == cudaSuccess) break;
    std::string msg;
    if (q != cudaErrorNotReady) {
      cudaEventDestroy(ev);
      check_cuda(q, {"nccl", "barrier", rank_});
    }
    if (now_s() > deadline) {
      cudaEventDestroy(ev);
      msg = detail::concat("[rank ", rank_, "] nccl barrier timed out after ", opts.timeout_s,
                           " s (a peer did not enter it); the communicator was aborted");
      abort_locked(msg, true);
      throw TimeoutError(msg, "barrier", "nccl", 0, rank_);
    }
    lock.unlock();
    pacer.pause();
  }
  cudaEventDestroy(ev);
}

}  // namespace compcomm::nccl
