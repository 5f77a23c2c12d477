#include "mpi_comm.h"

#include "../kernels/half.h"
#include "backoff.h"
#include "mpi_staging.h"

#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI's extensions: MPIX_Query_cuda_support
#endif

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <thread>

#ifdef __linux__
#include <sched.h>
#endif
#include <vector>

namespace compcomm {
namespace {

// More ranks on this node than cores this process may run on? The launchers' environment says how
// many ranks share the node (Open MPI, MPICH/Hydra); unknown counts as not oversubscribed.
bool node_oversubscribed() {
  int local = 0;
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"})
    if (const char* v = std::getenv(name)) local = std::max(local, std::atoi(v));
  int cores = static_cast<int>(std::thread::hardware_concurrency());
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
#endif
  return cores > 0 && local > cores;
}

// ---- MPI initialization ---------------------------------------------------------------------------

std::mutex g_init_mu;

// Set once a call of this process gave up on MPI requests (a timeout, or an error with requests
// pending): MPI_Finalize would then wait for peers that may never come, so the exit skips it.
std::atomic<bool> g_abandoned{false};

void finalize_at_exit() {
  if (g_abandoned) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

// Initializes MPI unless it is; returns its thread level (MPI_THREAD_*).
int ensure_mpi() {
  std::lock_guard<std::mutex> lock(g_init_mu);
  int finalized = 0, initialized = 0, provided = 0;
  MPI_Finalized(&finalized);
  if (finalized)
    throw Unsupported("MPI has already been finalized in this process; an MPI communicator cannot be made",
                      "MPI_Init_thread", "mpi", 0, -1);
  MPI_Initialized(&initialized);
  if (initialized) {
    MPI_Query_thread(&provided);
    return provided;
  }
  const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  if (rc != MPI_SUCCESS)
    throw BackendError(detail::concat("MPI_Init_thread failed with code ", rc), "MPI_Init_thread", "mpi", rc,
                       -1);
  // Errors raise, not abort the job: Open MPI reports a failed request of a non-blocking collective
  // (MPI_Test) through MPI_COMM_WORLD's handler, not the duplicated communicator's. mpi4py, when it
  // initializes MPI, sets the same.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN);
  // We initialized MPI, so we finalize it; a library that initialized it (mpi4py) finalizes it itself.
  std::atexit(finalize_at_exit);
  return provided;
}

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    default: return "MPI_THREAD_MULTIPLE";
  }
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

// ---- The communicator -----------------------------------------------------------------------------

MpiCommunicator::MpiCommunicator(MPI_Comm comm, CudaAware cuda_aware, double timeout_s) {
  COMPCOMM_CHECK(timeout_s > 0, "MpiCommunicator: timeout_s must be positive, got ", timeout_s);
  thread_level_ = ensure_mpi();
  COMPCOMM_CHECK(comm != MPI_COMM_NULL, "MpiCommunicator: comm is MPI_COMM_NULL (this process is not in it)");
  MPI_Comm_rank(comm, &rank_);
  check_usable("MpiCommunicator");  // the thread
  // MPI_Comm_idup, polled: a rank that never joins gives a TimeoutError here too, not a hang.
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = MPI_Comm_idup(comm, &comm_, &req);
  policy_ = node_oversubscribed() ? BackoffPolicy::oversubscribed() : BackoffPolicy{};
  if (rc == MPI_SUCCESS)
    poll_until(
        policy_, now_s() + timeout_s, 0,
        [&](bool*) {
          int flag = 0;
          rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
          return rc != MPI_SUCCESS || flag != 0;
        },
        [&] {
          mark_broken("MPI_Comm_idup timed out", true);
          throw TimeoutError(detail::concat("[rank ", rank_, "] mpi MPI_Comm_idup did not complete within ",
                                            timeout_s, " s: a rank of the communicator did not join"),
                             "MPI_Comm_idup", "mpi", 0, rank_);
        });
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
  return staging_bytes_.load();
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
  mark_broken(detail::concat(call, " failed with MPI error class ", cls), false);
  throw BackendError(detail::concat("[rank ", rank_, "] mpi ", call, " failed: ", error_string(rc),
                                    " (MPI error class ", cls, ")"),
                     call, "mpi", rc, rank_);
}

std::string MpiCommunicator::do_thread_restriction() const {
  if (thread_level_ >= MPI_THREAD_MULTIPLE) return "";
  return detail::concat("MPI was initialized with thread level ", thread_level_name(thread_level_),
                        ", so only the thread that initialized it may call compcomm's MPI communicator; "
                        "initialize MPI with MPI_THREAD_MULTIPLE (mpi4py's default, "
                        "mpi4py.rc.thread_level = \"multiple\"), or let compcomm initialize it");
}

void MpiCommunicator::check_usable(const char* call) const {
  if (thread_level_ < MPI_THREAD_MULTIPLE) {
    int main_thread = 0;
    MPI_Is_thread_main(&main_thread);
    if (!main_thread)
      throw Unsupported(detail::concat("[rank ", rank_, "] mpi ", call, ": called from a thread other than ",
                                       "the one that initialized MPI. ", do_thread_restriction()),
                        call, "mpi", 0, rank_);
  }
  if (broken_)
    throw BackendError(detail::concat("[rank ", rank_, "] mpi ", call, ": this communicator is unusable ",
                                      "since an earlier call failed (", broken_reason_,
                                      "); MPI cannot cancel a collective, so make a new communicator"),
                       call, "mpi", 0, rank_);
}

void MpiCommunicator::mark_broken(const std::string& reason, bool requests_left) {
  if (!broken_) broken_reason_ = reason;
  broken_ = true;
  if (requests_left) requests_left_ = g_abandoned = true;
}

void MpiCommunicator::timed_out(const char* call, double timeout_s) {
  mark_broken(detail::concat(call, " timed out"), true);
  throw TimeoutError(detail::concat("[rank ", rank_, "] mpi ", call, " did not complete within ", timeout_s,
                                    " s: a peer died, hung, or called a different collective"),
                     call, "mpi", 0, rank_);
}

void MpiCommunicator::wait(const char* call, MPI_Request* req, int64_t bytes, double deadline,
                           double timeout_s) {
  poll_until(
      policy_, deadline, bytes,
      [&](bool*) {
        int flag = 0;
        check(MPI_Test(req, &flag, MPI_STATUS_IGNORE), call);
        return flag != 0;
      },
      [&] { timed_out(call, timeout_s); });
}

int64_t MpiCommunicator::piece_bytes(const Buffer& buf) const {
  // Pieces on host buffers too: measured no slower than whole messages (2 ranks, 4 MiB per peer),
  // and the CPU tests then run the staged path's piece plan.
  const int64_t whole = int64_t{1} << 30;  // under MPI's int count limit
  if ((!buf.on_host() && cuda_aware_) || chunk_bytes_ == 0) return whole;
  return std::min(chunk_bytes_, whole);
}

// ---- The collectives ------------------------------------------------------------------------------

// Both exchanges pair rank r with r+s (sends) and r-s (receives) at step s, so at every step each
// rank sends to one peer and receives from another, and every message is posted at once.
void MpiCommunicator::do_all_to_all(const Buffer& send, const Buffer& recv, const CallOptions& opts) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t b = send.bytes() / size_, piece = piece_bytes(recv);
  std::vector<Msg> sends, recvs;
  std::vector<std::pair<int64_t, int64_t>> pieces;
  for (int s = 1; s < size_; ++s) {
    const int to = (rank_ + s) % size_, from = (rank_ - s + size_) % size_;
    for (int64_t o = 0; o < b; o += piece) {
      const int64_t len = std::min(piece, b - o);
      sends.push_back({to, to * b + o, len});
      pieces.emplace_back(to * b + o, len);
      recvs.push_back({from, from * b + o, len});
    }
  }
  exchange("all_to_all", send, recv, sends, recvs, pieces, rank_ * b, rank_ * b, b, opts);
}

void MpiCommunicator::do_all_gather(const Buffer& send, const Buffer& recv, const CallOptions& opts) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t b = send.bytes(), piece = piece_bytes(recv);
  std::vector<Msg> sends, recvs;
  std::vector<std::pair<int64_t, int64_t>> pieces;
  for (int64_t o = 0; o < b; o += piece) {  // each piece to every peer
    const int64_t len = std::min(piece, b - o);
    for (int s = 1; s < size_; ++s) {
      const int to = (rank_ + s) % size_, from = (rank_ - s + size_) % size_;
      sends.push_back({to, o, len});
      recvs.push_back({from, from * b + o, len});
    }
    pieces.emplace_back(o, len);
  }
  exchange("all_gather", send, recv, sends, recvs, pieces, 0, rank_ * b, b, opts);
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
  wait("barrier", &req, 0, deadline, opts.timeout_s);
}

}  // namespace compcomm
