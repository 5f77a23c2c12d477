#include "mpi_comm.h"

#include "../kernels/half.h"

#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI's extensions: MPIX_Query_cuda_support
#endif

#ifdef COMPCOMM_MPI_CUDA
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace compcomm {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Polling back-off: spin briefly (low latency for small messages), then yield, then sleep up to half
// a millisecond, so that oversubscribed ranks leave the cores to the peers they wait for.
void pause(int iter) {
  if (iter < 64) return;
  if (iter < 256) {
    std::this_thread::yield();
    return;
  }
  const int us = std::min(500, 10 << std::min(iter - 256, 6));
  std::this_thread::sleep_for(std::chrono::microseconds(us));
}

// ---- MPI initialization ---------------------------------------------------------------------------

std::mutex g_init_mu;

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void ensure_mpi() {
  std::lock_guard<std::mutex> lock(g_init_mu);
  int finalized = 0, initialized = 0;
  MPI_Finalized(&finalized);
  if (finalized)
    throw Unsupported("MPI has already been finalized in this process; an MPI communicator cannot be made",
                      "MPI_Init_thread", "mpi", 0, -1);
  MPI_Initialized(&initialized);
  if (initialized) return;
  int provided = 0;
  const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  if (rc != MPI_SUCCESS)
    throw BackendError(detail::concat("MPI_Init_thread failed with code ", rc), "MPI_Init_thread", "mpi", rc,
                       -1);
  // We initialized MPI, so we finalize it; a library that initialized it (mpi4py) finalizes it itself.
  std::atexit(finalize_at_exit);
}

std::string error_string(int rc) {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return detail::concat("MPI error ", rc);
  return std::string(text, static_cast<size_t>(len));
}

// ---- 16-bit floats: MPI has no such types, so reductions use our own MPI_Ops ---------------------

using half::bf16_to_float;
using half::float_to_bf16;
using half::float_to_half;
using half::half_to_float;

struct SumOp {
  float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {  // NaN propagates, like torch.maximum
  float operator()(float a, float b) const { return (a > b || std::isnan(a)) ? a : b; }
};
struct MinOp {
  float operator()(float a, float b) const { return (a < b || std::isnan(a)) ? a : b; }
};

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float), class Op>
void reduce16(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  Op op;
  for (int i = 0; i < *len; ++i) b[i] = FromF(op(ToF(a[i]), ToF(b[i])));
}

struct HalfOps {
  MPI_Op op[2][3];  // [fp16, bf16][sum, max, min]
};

const HalfOps& half_ops() {
  static const HalfOps ops = [] {
    HalfOps o{};
    MPI_Op_create(&reduce16<half_to_float, float_to_half, SumOp>, 1, &o.op[0][0]);
    MPI_Op_create(&reduce16<half_to_float, float_to_half, MaxOp>, 1, &o.op[0][1]);
    MPI_Op_create(&reduce16<half_to_float, float_to_half, MinOp>, 1, &o.op[0][2]);
    MPI_Op_create(&reduce16<bf16_to_float, float_to_bf16, SumOp>, 1, &o.op[1][0]);
    MPI_Op_create(&reduce16<bf16_to_float, float_to_bf16, MaxOp>, 1, &o.op[1][1]);
    MPI_Op_create(&reduce16<bf16_to_float, float_to_bf16, MinOp>, 1, &o.op[1][2]);
    return o;
  }();
  return ops;
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::kFloat32: return MPI_FLOAT;
    case DType::kFloat64: return MPI_DOUBLE;
    case DType::kInt32: return MPI_INT32_T;
    case DType::kInt64: return MPI_INT64_T;
    case DType::kUInt8: return MPI_UINT8_T;
    case DType::kFloat16:
    case DType::kBFloat16: return MPI_UINT16_T;  // reduced by the ops above
  }
  return MPI_BYTE;
}

MPI_Op mpi_op(DType t, ReduceOp op) {
  const int k = static_cast<int>(op);
  if (t == DType::kFloat16 || t == DType::kBFloat16) return half_ops().op[t == DType::kBFloat16][k];
  switch (op) {
    case ReduceOp::kSum: return MPI_SUM;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kMin: return MPI_MIN;
  }
  return MPI_SUM;
}

// MPI counts are ints.
int count_of(int64_t n, const char* call, const char* what, int rank) {
  if (n > INT_MAX)
    throw Unsupported(detail::concat("[rank ", rank, "] mpi ", call, ": ", what, " of ", n,
                                     " exceeds MPI's int count limit; split the buffer"),
                      call, "mpi", 0, rank);
  return static_cast<int>(n);
}

bool query_cuda_support() {
  if (const char* env = std::getenv("COMPCOMM_MPI_CUDA_AWARE")) {
    if (env[0] == '1') return true;
    if (env[0] == '0') return false;
  }
#if defined(OMPI_HAVE_MPI_EXT_CUDA) && OMPI_HAVE_MPI_EXT_CUDA
  return MPIX_Query_cuda_support() == 1;
#elif defined(MPIX_GPU_SUPPORT_CUDA)
  int supported = 0;
  MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &supported);
  return supported != 0;
#else
  return false;
#endif
}

}  // namespace

bool mpi_reports_cuda_support() {
  ensure_mpi();
  return query_cuda_support();
}

std::string mpi_library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {0};
  int len = 0;
  MPI_Get_library_version(text, &len);
  std::string s(text, static_cast<size_t>(len));
  const size_t eol = s.find_first_of("\r\n");
  if (eol != std::string::npos) s.resize(eol);
  while (!s.empty() && (s.back() == ' ' || s.back() == ',' || s.back() == '\0')) s.pop_back();
  return s;
}

bool mpi_cuda_built() {
#ifdef COMPCOMM_MPI_CUDA
  return true;
#else
  return false;
#endif
}

// ---- Host staging for device buffers (CUDA builds) ------------------------------------------------

#ifdef COMPCOMM_MPI_CUDA

namespace {
[[noreturn]] void cuda_fail(cudaError_t e, const char* what, const char* call, int rank) {
  throw BackendError(detail::concat("[rank ", rank, "] mpi ", call, ": ", what, " failed: ",
                                    cudaGetErrorName(e), ": ", cudaGetErrorString(e)),
                     call, "cuda", static_cast<int>(e), rank);
}
#define COMPCOMM_CHECK_CUDA(expr)                    \
  do {                                               \
    const cudaError_t e_ = (expr);                   \
    if (e_ != cudaSuccess) cuda_fail(e_, #expr, call, rank_); \
  } while (0)

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
};

cudaStream_t stream_of(const CallOptions& opts) { return static_cast<cudaStream_t>(opts.stream); }
}  // namespace

struct MpiCommunicator::Staging {
  void* host[2] = {nullptr, nullptr};
  int64_t capacity[2] = {0, 0};
  int device = -1;
  cudaEvent_t done = nullptr;        // recorded after the last copy back; staging is free once it fired
  std::vector<cudaEvent_t> events;   // per-chunk "copied to host" events

  void release_events() {
    if (done) cudaEventDestroy(done);
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    done = nullptr;
    events.clear();
  }
  ~Staging() {
    if (done) cudaEventSynchronize(done);
    release_events();
    for (void* p : host)
      if (p) cudaFreeHost(p);
  }
};

namespace {
// Polls an event (or finished-ness of stream work) until the deadline.
bool event_ready(cudaEvent_t ev, const char* call, int rank) {
  const cudaError_t e = cudaEventQuery(ev);
  if (e == cudaSuccess) return true;
  if (e != cudaErrorNotReady) cuda_fail(e, "cudaEventQuery", call, rank);
  return false;
}
}  // namespace

#else
struct MpiCommunicator::Staging {};
#endif  // COMPCOMM_MPI_CUDA

// ---- The communicator -----------------------------------------------------------------------------

MpiCommunicator::MpiCommunicator(MPI_Comm comm, CudaAware cuda_aware, double timeout_s) {
  COMPCOMM_CHECK(timeout_s > 0, "MpiCommunicator: timeout_s must be positive, got ", timeout_s);
  ensure_mpi();
  COMPCOMM_CHECK(comm != MPI_COMM_NULL, "MpiCommunicator: comm is MPI_COMM_NULL (this process is not in it)");
  MPI_Comm_rank(comm, &rank_);
  // MPI_Comm_idup, polled: a rank that never joins gives a TimeoutError here too, not a hang.
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = MPI_Comm_idup(comm, &comm_, &req);
  const double deadline = now_s() + timeout_s;
  for (int iter = 0, flag = 0; rc == MPI_SUCCESS && !flag; ++iter) {
    rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
    if (rc == MPI_SUCCESS && !flag && now_s() > deadline) {
      broken_ = true;
      throw TimeoutError(detail::concat("[rank ", rank_, "] mpi MPI_Comm_idup did not complete within ",
                                        timeout_s, " s: a rank of the communicator did not join"),
                         "MPI_Comm_idup", "mpi", 0, rank_);
    }
    pause(iter);
  }
  if (rc != MPI_SUCCESS)
    throw BackendError(detail::concat("[rank ", rank_, "] mpi MPI_Comm_idup failed: ", error_string(rc)),
                       "MPI_Comm_idup", "mpi", rc, rank_);
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);

  const bool reported = query_cuda_support();
  if (cuda_aware == CudaAware::kOn) {
    std::string why;
    if (!mpi_cuda_built())
      why = "this build of compcomm has no CUDA runtime (no CUDA toolkit was found when it was built)";
    else if (!reported)
      why = detail::concat("the MPI library (", mpi_library_version(),
                           ") does not report CUDA support (MPIX_Query_cuda_support() is 0; with Open MPI "
                           "check `ompi_info --parsable --all | grep mpi_built_with_cuda_support`)");
    if (!why.empty()) {
      MPI_Comm_free(&comm_);
      throw Unsupported(detail::concat("[rank ", rank_, "] cuda_aware=True was requested but ", why,
                                       ". Use cuda_aware=False (host-staged through pinned memory) or "
                                       "None (detect); set COMPCOMM_MPI_CUDA_AWARE=1 only for an MPI "
                                       "that is CUDA-aware but cannot report it (MVAPICH2-GDR)."),
                        "MpiCommunicator", "mpi", 0, rank_);
    }
  }
  cuda_aware_ = cuda_aware == CudaAware::kOn || (cuda_aware == CudaAware::kDetect && reported &&
                                                 mpi_cuda_built());
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (broken_) {
    // A timed-out collective may still write its buffers: keep them (and the communicator) alive.
    (void)staging_.release();
    return;
  }
  if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

int64_t MpiCommunicator::staging_bytes() const {
#ifdef COMPCOMM_MPI_CUDA
  return staging_ ? staging_->capacity[0] + staging_->capacity[1] : 0;
#else
  return 0;
#endif
}

void MpiCommunicator::set_pipeline_chunk_bytes(int64_t bytes) {
  COMPCOMM_CHECK(bytes >= 0, "pipeline_chunk_bytes must be >= 0, got ", bytes);
  std::lock_guard<std::mutex> lock(mu_);
  chunk_bytes_ = bytes;
}

void MpiCommunicator::check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  int cls = 0;
  MPI_Error_class(rc, &cls);
  broken_ = true;
  broken_reason_ = detail::concat(call, " failed with MPI error class ", cls);
  throw BackendError(detail::concat("[rank ", rank_, "] mpi ", call, " failed: ", error_string(rc),
                                    " (MPI error class ", cls, ")"),
                     call, "mpi", rc, rank_);
}

void MpiCommunicator::check_usable(const char* call) const {
  if (broken_)
    throw BackendError(detail::concat("[rank ", rank_, "] mpi ", call, ": this communicator is unusable ",
                                      "since an earlier call failed (", broken_reason_,
                                      "); MPI cannot cancel a collective, so make a new communicator"),
                       call, "mpi", 0, rank_);
}

void MpiCommunicator::timed_out(const char* call, double timeout_s) {
  broken_ = true;
  broken_reason_ = detail::concat(call, " timed out");
  throw TimeoutError(detail::concat("[rank ", rank_, "] mpi ", call, " did not complete within ", timeout_s,
                                    " s: a peer died, hung, or called a different collective"),
                     call, "mpi", 0, rank_);
}

void MpiCommunicator::wait(const char* call, MPI_Request* req, double deadline, double timeout_s) {
  for (int iter = 0;; ++iter) {
    int flag = 0;
    check(MPI_Test(req, &flag, MPI_STATUS_IGNORE), call);
    if (flag) return;
    if (now_s() > deadline) timed_out(call, timeout_s);
    pause(iter);
  }
}

#ifdef COMPCOMM_MPI_CUDA
MpiCommunicator::Staging& MpiCommunicator::staging(int device, double deadline, const char* call,
                                                   double timeout_s) {
  if (!staging_) staging_ = std::make_unique<Staging>();
  Staging& st = *staging_;
  if (st.done) {  // the previous call's copy back reads the staging buffers until this event fires
    for (int iter = 0; !event_ready(st.done, call, rank_); ++iter) {
      if (now_s() > deadline) timed_out(call, timeout_s);
      pause(iter);
    }
  }
  if (st.device != device) {  // events belong to a device
    st.release_events();
    st.device = device;
  }
  if (!st.done) COMPCOMM_CHECK_CUDA(cudaEventCreateWithFlags(&st.done, cudaEventDisableTiming));
  return st;
}
#endif

void MpiCommunicator::run(const char* call, const Buffer& send, int64_t send_bytes, const Buffer& recv,
                          int64_t recv_bytes, int64_t in_place_offset, const Start& start,
                          const CallOptions& opts) {
  check_usable(call);
  const double deadline = now_s() + opts.timeout_s;
  MPI_Request req = MPI_REQUEST_NULL;
  const bool in_place =
      in_place_offset >= 0 && send.data == static_cast<const char*>(recv.data) + in_place_offset;
  if (recv.on_host() || cuda_aware_) {
    if (!recv.on_host()) {
#ifdef COMPCOMM_MPI_CUDA
      // MPI reads device memory directly: the producer's work on the stream must be done first.
      DeviceGuard guard(recv.device);
      COMPCOMM_CHECK_CUDA(cudaStreamSynchronize(stream_of(opts)));
#endif
    }
    check(start(in_place ? nullptr : send.data, recv.data, &req), call);
    wait(call, &req, deadline, opts.timeout_s);
    return;
  }
#ifdef COMPCOMM_MPI_CUDA
  // Host-staged: send goes to staging (at its in-place offset in the recv region when MPI supports it,
  // which saves a second buffer), MPI runs on host memory, recv is copied back on the stream.
  DeviceGuard guard(recv.device);
  cudaStream_t stream = stream_of(opts);
  Staging& st = staging(recv.device, deadline, call, opts.timeout_s);
  const bool stage_in_place = in_place_offset >= 0;
  const int64_t region = stage_in_place ? std::max(recv_bytes, in_place_offset + send_bytes) : recv_bytes;
  auto reserve = [&](int which, int64_t bytes) -> char* {
    if (st.capacity[which] < bytes) {
      const int64_t grown = std::max<int64_t>(bytes, st.capacity[which] * 3 / 2);
      if (st.host[which]) COMPCOMM_CHECK_CUDA(cudaFreeHost(st.host[which]));
      st.host[which] = nullptr;
      st.capacity[which] = 0;
      COMPCOMM_CHECK_CUDA(cudaHostAlloc(&st.host[which], static_cast<size_t>(grown), cudaHostAllocPortable));
      st.capacity[which] = grown;
    }
    return static_cast<char*>(st.host[which]);
  };
  char* r = reserve(1, region);
  char* s = stage_in_place ? r + in_place_offset : reserve(0, send_bytes);
  if (send_bytes > 0)
    COMPCOMM_CHECK_CUDA(cudaMemcpyAsync(s, send.data, static_cast<size_t>(send_bytes), cudaMemcpyDeviceToHost,
                                        stream));
  COMPCOMM_CHECK_CUDA(cudaEventRecord(st.done, stream));
  for (int iter = 0; !event_ready(st.done, call, rank_); ++iter) {
    if (now_s() > deadline) timed_out(call, opts.timeout_s);
    pause(iter);
  }
  check(start(stage_in_place ? nullptr : s, r, &req), call);
  wait(call, &req, deadline, opts.timeout_s);
  if (recv_bytes > 0)
    COMPCOMM_CHECK_CUDA(cudaMemcpyAsync(recv.data, r, static_cast<size_t>(recv_bytes), cudaMemcpyHostToDevice,
                                        stream));
  COMPCOMM_CHECK_CUDA(cudaEventRecord(st.done, stream));
#else
  (void)send_bytes;
  (void)recv_bytes;
  (void)deadline;
  throw Unsupported(detail::concat("[rank ", rank_, "] mpi ", call,
                                   ": the buffers are on a CUDA device but this build of compcomm has no "
                                   "CUDA runtime"),
                    call, "mpi", 0, rank_);
#endif
}

void MpiCommunicator::run_staged_chunked(const char* call, const Buffer& buf, bool copy_in, bool copy_out,
                                         const std::function<int(void*, int64_t, MPI_Request*)>& start_chunk,
                                         const CallOptions& opts) {
#ifdef COMPCOMM_MPI_CUDA
  check_usable(call);
  const double deadline = now_s() + opts.timeout_s;
  DeviceGuard guard(buf.device);
  cudaStream_t stream = stream_of(opts);
  const int64_t esize = static_cast<int64_t>(dtype_size(buf.dtype));
  const int64_t per = chunk_bytes_ > 0 ? std::max<int64_t>(1, chunk_bytes_ / esize) : std::max<int64_t>(1, buf.count);
  const int64_t nchunks = buf.count == 0 ? 0 : (buf.count + per - 1) / per;
  Staging& st = staging(buf.device, deadline, call, opts.timeout_s);
  if (st.capacity[1] < buf.bytes()) {
    const int64_t grown = std::max<int64_t>(buf.bytes(), st.capacity[1] * 3 / 2);
    if (st.host[1]) COMPCOMM_CHECK_CUDA(cudaFreeHost(st.host[1]));
    st.host[1] = nullptr;
    st.capacity[1] = 0;
    COMPCOMM_CHECK_CUDA(cudaHostAlloc(&st.host[1], static_cast<size_t>(grown), cudaHostAllocPortable));
    st.capacity[1] = grown;
  }
  char* host = static_cast<char*>(st.host[1]);
  while (static_cast<int64_t>(st.events.size()) < nchunks) {
    cudaEvent_t e;
    COMPCOMM_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    st.events.push_back(e);
  }
  auto chunk = [&](int64_t i, int64_t* off, int64_t* n) {
    *off = i * per;
    *n = std::min(per, buf.count - *off);
  };
  auto* dev = static_cast<char*>(buf.data);
  if (copy_in)
    for (int64_t i = 0; i < nchunks; ++i) {
      int64_t off, n;
      chunk(i, &off, &n);
      COMPCOMM_CHECK_CUDA(cudaMemcpyAsync(host + off * esize, dev + off * esize, static_cast<size_t>(n * esize),
                                          cudaMemcpyDeviceToHost, stream));
      COMPCOMM_CHECK_CUDA(cudaEventRecord(st.events[i], stream));
    }
  std::vector<MPI_Request> reqs(static_cast<size_t>(nchunks), MPI_REQUEST_NULL);
  int64_t posted = 0, finished = 0;
  for (int iter = 0; finished < nchunks; ++iter) {
    bool progress = false;
    while (posted < nchunks &&
           (!copy_in || event_ready(st.events[posted], call, rank_))) {
      int64_t off, n;
      chunk(posted, &off, &n);
      check(start_chunk(host + off * esize, n, &reqs[posted]), call);
      ++posted;
      progress = true;
    }
    if (finished < posted) {
      int flag = 0;
      check(MPI_Test(&reqs[finished], &flag, MPI_STATUS_IGNORE), call);
      if (flag) {
        if (copy_out) {
          int64_t off, n;
          chunk(finished, &off, &n);
          COMPCOMM_CHECK_CUDA(cudaMemcpyAsync(dev + off * esize, host + off * esize,
                                              static_cast<size_t>(n * esize), cudaMemcpyHostToDevice, stream));
        }
        ++finished;
        progress = true;
      }
    }
    if (progress) {
      iter = 0;
      continue;
    }
    if (now_s() > deadline) timed_out(call, opts.timeout_s);
    pause(iter);
  }
  COMPCOMM_CHECK_CUDA(cudaEventRecord(st.done, stream));
#else
  (void)buf;
  (void)copy_in;
  (void)copy_out;
  (void)start_chunk;
  (void)opts;
  throw Unsupported(detail::concat("[rank ", rank_, "] mpi ", call,
                                   ": the buffer is on a CUDA device but this build of compcomm has no CUDA "
                                   "runtime"),
                    call, "mpi", 0, rank_);
#endif
}

// ---- The collectives ------------------------------------------------------------------------------

void MpiCommunicator::do_all_to_all(const Buffer& send, const Buffer& recv, const CallOptions& opts) {
  std::lock_guard<std::mutex> lock(mu_);
  const int n = count_of(send.bytes() / size_, "all_to_all", "bytes per rank", rank_);
  run("all_to_all", send, send.bytes(), recv, recv.bytes(), -1,
      [&](const void* s, void* r, MPI_Request* req) {
        return MPI_Ialltoall(s, n, MPI_BYTE, r, n, MPI_BYTE, comm_, req);
      },
      opts);
}

void MpiCommunicator::do_all_gather(const Buffer& send, const Buffer& recv, const CallOptions& opts) {
  std::lock_guard<std::mutex> lock(mu_);
  const int n = count_of(send.bytes(), "all_gather", "bytes per rank", rank_);
  run("all_gather", send, send.bytes(), recv, recv.bytes(), send.bytes() * rank_,
      [&](const void* s, void* r, MPI_Request* req) {
        return MPI_Iallgather(s ? s : MPI_IN_PLACE, n, MPI_BYTE, r, n, MPI_BYTE, comm_, req);
      },
      opts);
}

void MpiCommunicator::do_reduce_scatter(const Buffer& send, const Buffer& recv, ReduceOp op,
                                        const CallOptions& opts) {
  std::lock_guard<std::mutex> lock(mu_);
  const int n = count_of(recv.count, "reduce_scatter", "elements per rank", rank_);
  const MPI_Datatype type = mpi_type(recv.dtype);
  const MPI_Op mop = mpi_op(recv.dtype, op);
  // In place (input in recv's memory, result at its start) when staged: one staging buffer.
  run("reduce_scatter", send, send.bytes(), recv, recv.bytes(), 0,
      [&](const void* s, void* r, MPI_Request* req) {
        return MPI_Ireduce_scatter_block(s ? s : MPI_IN_PLACE, r, n, type, mop, comm_, req);
      },
      opts);
}

void MpiCommunicator::do_all_reduce(const Buffer& buf, ReduceOp op, const CallOptions& opts) {
  std::lock_guard<std::mutex> lock(mu_);
  const MPI_Datatype type = mpi_type(buf.dtype);
  const MPI_Op mop = mpi_op(buf.dtype, op);
  if (!buf.on_host() && !cuda_aware_) {
    run_staged_chunked("all_reduce", buf, true, true,
                       [&](void* p, int64_t count, MPI_Request* req) {
                         return MPI_Iallreduce(MPI_IN_PLACE, p, static_cast<int>(count), type, mop, comm_, req);
                       },
                       opts);
    return;
  }
  const int n = count_of(buf.count, "all_reduce", "element count", rank_);
  run("all_reduce", buf, buf.bytes(), buf, buf.bytes(), 0,
      [&](const void*, void* r, MPI_Request* req) {
        return MPI_Iallreduce(MPI_IN_PLACE, r, n, type, mop, comm_, req);
      },
      opts);
}

void MpiCommunicator::do_broadcast(const Buffer& buf, int root, const CallOptions& opts) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!buf.on_host() && !cuda_aware_) {
    const bool is_root = rank_ == root;
    run_staged_chunked("broadcast", Buffer{buf.data, buf.bytes(), DType::kUInt8, buf.device}, is_root,
                       !is_root,
                       [&](void* p, int64_t bytes, MPI_Request* req) {
                         return MPI_Ibcast(p, static_cast<int>(bytes), MPI_BYTE, root, comm_, req);
                       },
                       opts);
    return;
  }
  const int n = count_of(buf.bytes(), "broadcast", "bytes", rank_);
  run("broadcast", buf, 0, buf, buf.bytes(), 0,
      [&](const void*, void* r, MPI_Request* req) { return MPI_Ibcast(r, n, MPI_BYTE, root, comm_, req); },
      opts);
}

void MpiCommunicator::do_barrier(const CallOptions& opts) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable("barrier");
  const double deadline = now_s() + opts.timeout_s;
  MPI_Request req = MPI_REQUEST_NULL;
  check(MPI_Ibarrier(comm_, &req), "barrier");
  wait("barrier", &req, deadline, opts.timeout_s);
}

}  // namespace compcomm
