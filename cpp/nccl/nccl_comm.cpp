#include "nccl_comm.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include <chrono>
#include <cstdlib>
#include <cstring>

namespace compcomm::nccl {

namespace {

// The NCCL functions this file uses, resolved from the run-time library. Types come from the
// build-time header; only functions present since NCCL 2.14 are used.
struct Api {
  decltype(&::ncclGetVersion) GetVersion;
  decltype(&::ncclGetUniqueId) GetUniqueId;
  decltype(&::ncclCommInitRankConfig) CommInitRankConfig;
  decltype(&::ncclCommFinalize) CommFinalize;
  decltype(&::ncclCommDestroy) CommDestroy;
  decltype(&::ncclCommAbort) CommAbort;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&::ncclGetErrorString) GetErrorString;
  decltype(&::ncclGetLastError) GetLastError;
  decltype(&::ncclAllReduce) AllReduce;
  decltype(&::ncclBroadcast) Broadcast;
  decltype(&::ncclAllGather) AllGather;
  decltype(&::ncclReduceScatter) ReduceScatter;
  decltype(&::ncclSend) Send;
  decltype(&::ncclRecv) Recv;
  decltype(&::ncclGroupStart) GroupStart;
  decltype(&::ncclGroupEnd) GroupEnd;
  std::string path;
};

std::mutex g_load_mu;
const Api* g_api = nullptr;  // set once, never freed (the library stays loaded)

template <class F>
bool resolve(void* handle, const char* name, F& fn, std::string& missing) {
  fn = reinterpret_cast<F>(dlsym(handle, name));
  if (!fn) missing += std::string(missing.empty() ? "" : ", ") + name;
  return fn != nullptr;
}

// Fills `api` from `handle`; returns the names it could not find ("" if none).
std::string resolve_all(void* handle, Api& a) {
  std::string missing;
  resolve(handle, "ncclGetVersion", a.GetVersion, missing);
  resolve(handle, "ncclGetUniqueId", a.GetUniqueId, missing);
  resolve(handle, "ncclCommInitRankConfig", a.CommInitRankConfig, missing);
  resolve(handle, "ncclCommFinalize", a.CommFinalize, missing);
  resolve(handle, "ncclCommDestroy", a.CommDestroy, missing);
  resolve(handle, "ncclCommAbort", a.CommAbort, missing);
  resolve(handle, "ncclCommGetAsyncError", a.CommGetAsyncError, missing);
  resolve(handle, "ncclGetErrorString", a.GetErrorString, missing);
  resolve(handle, "ncclGetLastError", a.GetLastError, missing);
  resolve(handle, "ncclAllReduce", a.AllReduce, missing);
  resolve(handle, "ncclBroadcast", a.Broadcast, missing);
  resolve(handle, "ncclAllGather", a.AllGather, missing);
  resolve(handle, "ncclReduceScatter", a.ReduceScatter, missing);
  resolve(handle, "ncclSend", a.Send, missing);
  resolve(handle, "ncclRecv", a.Recv, missing);
  resolve(handle, "ncclGroupStart", a.GroupStart, missing);
  resolve(handle, "ncclGroupEnd", a.GroupEnd, missing);
  return missing;
}

const Api& api() {
  if (!g_api) load();
  return *g_api;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Sleeps a little between polls: spin-yield first (low latency for short waits), then back off.
void backoff(int& spins) {
  if (++spins < 2000) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 20000 ? 20 : 500));
  }
}

ncclComm_t as_comm(void* c) { return static_cast<ncclComm_t>(c); }
cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

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

// "<NCCL's string for the code>: <NCCL's last error message>".
std::string nccl_text(int result, void* comm) {
  const Api& a = api();
  std::string s = a.GetErrorString(static_cast<ncclResult_t>(result));
  const char* last = a.GetLastError(as_comm(comm));
  if (last && *last) s += std::string(": ") + last;
  return s;
}

void check_cuda(cudaError_t e, const char* call, int rank) {
  if (e == cudaSuccess) return;
  throw BackendError(detail::concat("[rank ", rank, "] nccl ", call, ": CUDA error ",
                                    cudaGetErrorName(e), ": ", cudaGetErrorString(e)),
                     call, "cuda", static_cast<int>(e), rank);
}

// Makes `device` current for the scope and restores the previous device afterwards.
class DeviceGuard {
 public:
  DeviceGuard(int device, const char* call, int rank) {
    check_cuda(cudaGetDevice(&prev_), call, rank);
    if (prev_ != device)
      check_cuda(cudaSetDevice(device), call, rank);
    else
      prev_ = -1;
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
};

// Like DeviceGuard but never throws: for abort and teardown paths, which must always complete.
class QuietDeviceGuard {
 public:
  explicit QuietDeviceGuard(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess || prev_ == device)
      prev_ = -1;
    else if (cudaSetDevice(device) != cudaSuccess)
      prev_ = -1;
    cudaGetLastError();
  }
  ~QuietDeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
};

bool capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(as_stream(stream), &status) != cudaSuccess) {
    cudaGetLastError();  // e.g. the legacy stream queried during another thread's capture
    return true;         // be conservative: never record/query events then
  }
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

std::string load(const std::vector<std::string>& candidates) {
  std::lock_guard<std::mutex> lock(g_load_mu);
  if (g_api) return g_api->path;
  std::vector<std::pair<std::string, int>> tries;  // (name, dlopen flags)
  if (const char* env = std::getenv("COMPCOMM_NCCL_LIBRARY"); env && *env)
    tries.push_back({env, 0});
  tries.push_back({"libnccl.so.2", RTLD_NOLOAD});  // already in the process (torch's copy)
  for (const auto& c : candidates) tries.push_back({c, 0});
  tries.push_back({"libnccl.so.2", 0});  // the dynamic linker's search path (a system NCCL)
  std::string tried;
  for (const auto& [name, flags] : tries) {
    void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL | flags);
    if (!h) {
      if (!(flags & RTLD_NOLOAD)) {
        const char* err = dlerror();
        tried += "\n  " + name + ": " + (err ? err : "not found");
      }
      continue;
    }
    auto* a = new Api{};
    const std::string missing = resolve_all(h, *a);
    if (!missing.empty()) {
      tried += "\n  " + name + ": lacks " + missing + " (NCCL >= 2.14 is needed)";
      delete a;
      dlclose(h);
      continue;
    }
    Dl_info info{};
    a->path = dladdr(reinterpret_cast<void*>(a->GetVersion), &info) && info.dli_fname
                  ? info.dli_fname
                  : name;
    g_api = a;
    return a->path;
  }
  throw Unsupported("NCCL library not found; tried:" + tried +
                        "\nInstall torch with CUDA (it ships NCCL) or nvidia-nccl-cu13, or set "
                        "COMPCOMM_NCCL_LIBRARY to libnccl.so.2",
                    "load", "nccl", 0, -1);
}

bool loaded() {
  std::lock_guard<std::mutex> lock(g_load_mu);
  return g_api != nullptr;
}

int runtime_version() {
  int v = 0;
  const ncclResult_t r = api().GetVersion(&v);
  if (r != ncclSuccess)
    throw BackendError("ncclGetVersion failed: " + nccl_text(r, nullptr), "version", "nccl", r);
  return v;
}

std::string unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = api().GetUniqueId(&id);
  if (r != ncclSuccess)
    throw BackendError("ncclGetUniqueId failed: " + nccl_text(r, nullptr), "unique_id", "nccl", r);
  static_assert(sizeof(id.internal) == kUniqueIdBytes, "NCCL_UNIQUE_ID_BYTES changed");
  return std::string(id.internal, sizeof(id.internal));
}

struct NcclCommunicator::Pending {
  cudaEvent_t event;
  double deadline;
  double timeout_s;
  const char* call;
};

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
        device_(c.device_, name, c.rank_) {
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
  void cuda(cudaError_t e) const { check_cuda(e, name_, c_.rank_); }
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
  DeviceGuard guard(device, "init", rank);

  ncclUniqueId id;
  std::memcpy(id.internal, id_bytes.data(), kUniqueIdBytes);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = blocking ? 1 : 0;
  ncclComm_t c = nullptr;
  ncclResult_t r = a.CommInitRankConfig(&c, size, id, rank, &config);
  const double deadline = now_s() + timeout_s;
  int spins = 0;
  while (c && !blocking && (r == ncclSuccess || r == ncclInProgress)) {
    ncclResult_t st = ncclSuccess;
    const ncclResult_t q = a.CommGetAsyncError(c, &st);
    r = q != ncclSuccess ? q : st;
    if (r != ncclInProgress) break;
    if (now_s() > deadline) {
      a.CommAbort(c);
      throw TimeoutError(detail::concat("[rank ", rank, "] nccl init: the ", size,
                                        " ranks did not all join within ", timeout_s,
                                        " s; the communicator was aborted"),
                         "init", "nccl", ncclInProgress, rank);
    }
    backoff(spins);
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
    check_cuda(e, "init", rank);
  }
  if (watchdog) watchdog_ = std::thread(&NcclCommunicator::watchdog_loop, this);
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
  int spins = 0;
  while (result == ncclInProgress) {  // non-blocking mode: wait for NCCL to finish the host side
    ncclResult_t st = ncclSuccess;
    const ncclResult_t q = a.CommGetAsyncError(as_comm(comm_), &st);
    result = q != ncclSuccess ? q : st;
    if (result != ncclInProgress) break;
    if (now_s() > deadline_s) {
      const std::string msg =
          detail::concat("[rank ", rank_, "] nccl ", call,
                         " timed out: the peers did not answer; the communicator was aborted");
      abort_locked(msg, true);
      throw TimeoutError(msg, call, "nccl", ncclInProgress, rank_);
    }
    backoff(spins);
  }
  if (result == ncclSuccess) return;
  const std::string msg =
      detail::concat("[rank ", rank_, "] nccl ", call, " failed: ", nccl_text(result, comm_));
  // A rejected argument leaves the communicator usable; any other failure leaves it in an unknown
  // state, so it is aborted rather than used again.
  if (result != ncclInvalidArgument && result != ncclInvalidUsage) abort_locked(msg, false);
  throw BackendError(msg, call, "nccl", result, rank_);
}

void NcclCommunicator::track_locked(void* stream, double timeout_s, const char* call) {
  // A world of one rank has no peer to wait for: nothing can hang, so no event is needed.
  if (size_ == 1 || !watchdog_.joinable() || capturing(stream)) return;
  cudaEvent_t ev;
  if (!free_events_.empty()) {
    ev = static_cast<cudaEvent_t>(free_events_.back());
    free_events_.pop_back();
  } else {
    check_cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "watchdog", rank_);
  }
  const cudaError_t e = cudaEventRecord(ev, as_stream(stream));
  if (e != cudaSuccess) {
    free_events_.push_back(ev);
    check_cuda(e, "watchdog", rank_);
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
    int spins = 0;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (closed_) throw_closed_locked("synchronize");
        const cudaError_t q = cudaEventQuery(ev);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) check_cuda(q, "synchronize", rank_);
        if (now_s() > deadline) {
          const std::string msg = detail::concat("[rank ", rank_,
                                                 "] nccl synchronize: device work did not finish "
                                                 "within ",
                                                 timeout_s, " s; the communicator was aborted");
          abort_locked(msg, true);
          throw TimeoutError(msg, "synchronize", "nccl", 0, rank_);
        }
      }
      backoff(spins);
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
    int spins = 0;
    for (auto& p : pending_) {  // let tracked device work finish first (a dead peer: abort instead)
      cudaError_t q;
      while ((q = cudaEventQuery(p->event)) == cudaErrorNotReady && now_s() < deadline)
        backoff(spins);
      ok = ok && q == cudaSuccess;
    }
    ncclResult_t r = ok ? a.CommFinalize(as_comm(comm_)) : ncclInternalError;
    while (ok && r == ncclInProgress) {
      if (a.CommGetAsyncError(as_comm(comm_), &r) != ncclSuccess) r = ncclInternalError;
      if (r == ncclInProgress && now_s() > deadline) break;
      backoff(spins);
    }
    if (ok && r == ncclSuccess) {
      a.CommDestroy(as_comm(comm_));
    } else {
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
  int spins = 0;
  for (;;) {
    std::unique_lock<std::mutex> lock(mu_);
    const cudaError_t q = cudaEventQuery(ev);
    if (q == cudaSuccess) break;
    std::string msg;
    if (closed_) {
      cudaEventDestroy(ev);
      throw_closed_locked("barrier");
    }
    if (q != cudaErrorNotReady) {
      cudaEventDestroy(ev);
      check_cuda(q, "barrier", rank_);
    }
    if (now_s() > deadline) {
      cudaEventDestroy(ev);
      msg = detail::concat("[rank ", rank_, "] nccl barrier timed out after ", opts.timeout_s,
                           " s (a peer did not enter it); the communicator was aborted");
      abort_locked(msg, true);
      throw TimeoutError(msg, "barrier", "nccl", 0, rank_);
    }
    lock.unlock();
    backoff(spins);
  }
  cudaEventDestroy(ev);
}

}  // namespace compcomm::nccl
