// MPI communicator: every Communicator operation as a non-blocking MPI collective polled against the
// call's deadline, so a dead or absent peer raises TimeoutError instead of hanging.
//
// Host buffers go to MPI as they are. CUDA device buffers take one of two paths, chosen once per
// communicator:
//   - CUDA-aware: the device pointers go to MPI (after the caller's stream is synchronized). Only
//     allowed when the MPI library reports CUDA support at run time.
//   - host-staged: the data is copied on the caller's stream into pinned host buffers (allocated once,
//     grown on demand, reused by every later call), MPI runs on host memory, and the result is copied
//     back on the same stream. all_reduce and broadcast are cut into chunks of pipeline_chunk_bytes
//     (1 MiB) so that the device-to-host copy of chunk i+1 and the host-to-device copy of chunk i-1
//     overlap MPI's work on chunk i; all_to_all and all_gather stage all they send first, then move
//     the messages, then copy back what arrived (overlapping those was up to 2x slower over TCP).
//
// all_to_all and all_gather are point-to-point exchanges (MPI_Isend/Irecv of messages of at most
// pipeline_chunk_bytes, every message posted at once, completions taken as they come); the others
// are MPI's non-blocking collectives. Every wait polls without sleeping while data may be in flight
// (backoff.h): Open MPI moves a transfer forward only inside MPI calls.
//
// MPI has no 16-bit float type: fp16/bf16 reductions use MPI_Ops defined here (fp32 arithmetic,
// one rounding per pairwise combine, like gloo's). Byte-moving collectives work for every dtype.
//
// MPI cannot cancel a collective. After a timeout the communicator refuses further calls (the
// timed-out operation may still complete and write its buffers if the peer shows up late).
#pragma once

#include <mpi.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../comm.h"
#include "backoff.h"

namespace compcomm {

// Whether the MPI library reports, at run time, that it can read and write CUDA device memory
// (Open MPI: MPIX_Query_cuda_support(); MPICH: MPIX_GPU_query_support()). False when it cannot tell.
// The environment variable COMPCOMM_MPI_CUDA_AWARE=1 (or 0) overrides the answer, for MPIs that
// are CUDA-aware but have no query (MVAPICH2-GDR). Initializes MPI if needed.
bool mpi_reports_cuda_support();
// The first line of MPI_Get_library_version() (callable before MPI_Init).
std::string mpi_library_version();
// Whether this build can move CUDA device buffers through MPI (compiled with the CUDA runtime).
bool mpi_cuda_built();

// How a communicator treats CUDA device buffers.
enum class CudaAware : int { kDetect = -1, kOff = 0, kOn = 1 };

class MpiCommunicator final : public Communicator {
 public:
  // Duplicates `comm` (so compcomm's traffic never matches the caller's) and sets MPI_ERRORS_RETURN on
  // the duplicate. Initializes MPI (MPI_THREAD_MULTIPLE requested) if nobody has; MPI is then finalized
  // at process exit, unless a call of this process gave up on MPI requests (a timeout): finalizing
  // would wait for the peers it gave up on. cuda_aware=kOn throws Unsupported when the MPI does not
  // report CUDA support or this build has no CUDA runtime; kDetect picks CUDA-aware exactly when both
  // are there. The duplication is itself collective: it raises TimeoutError after timeout_s if a rank
  // never joins. Below MPI_THREAD_MULTIPLE (MPI initialized so by the caller, or an MPI without
  // thread support) only the thread that initialized MPI may call it (Unsupported otherwise):
  // compcomm cannot serialize its calls with the caller's own MPI calls.
  explicit MpiCommunicator(MPI_Comm comm = MPI_COMM_WORLD, CudaAware cuda_aware = CudaAware::kDetect,
                           double timeout_s = 600.0);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend_name() const override { return "mpi"; }

  // True when device buffers go to MPI directly, false when they are staged through host memory.
  bool cuda_aware() const { return cuda_aware_; }
  // The duplicated communicator compcomm uses (not the one passed in).
  MPI_Comm handle() const { return comm_; }
  // Bytes of pinned host staging memory currently held (0 until a device buffer was staged).
  int64_t staging_bytes() const;
  // Piece size (bytes) of all_to_all/all_gather messages (except CUDA-aware) and of the host-staged
  // all_reduce/broadcast chunks; 0: one piece.
  void set_pipeline_chunk_bytes(int64_t bytes);
  int64_t pipeline_chunk_bytes() const { return chunk_bytes_; }

 protected:
  void do_all_to_all(const Buffer& send, const Buffer& recv, const CallOptions& opts) override;
  void do_all_gather(const Buffer& send, const Buffer& recv, const CallOptions& opts) override;
  void do_reduce_scatter(const Buffer& send, const Buffer& recv, ReduceOp op,
                         const CallOptions& opts) override;
  void do_all_reduce(const Buffer& buf, ReduceOp op, const CallOptions& opts) override;
  void do_broadcast(const Buffer& buf, int root, const CallOptions& opts) override;
  void do_barrier(const CallOptions& opts) override;
  bool do_requests_left() const override { return requests_left_; }
  std::string do_thread_restriction() const override;

 private:
  struct Staging;  // pinned host buffers and CUDA events (CUDA builds only; mpi_staging.h)
  using Start = std::function<int(const void* send, void* recv, MPI_Request* req)>;

  // Runs one collective: `start` posts it on (send, recv) host or device pointers. `send_bytes` of
  // `send` are read (or, when `in_place_offset >= 0`, they sit in recv at that offset and `start`
  // gets a null send), `recv_bytes` of `recv` are written.
  void run(const char* call, const Buffer& send, int64_t send_bytes, const Buffer& recv, int64_t recv_bytes,
           int64_t in_place_offset, const Start& start, const CallOptions& opts);
  // One point-to-point message of an exchange: bytes [off, off + bytes) of the send (or recv) buffer.
  struct Msg {
    int peer;
    int64_t off, bytes;
  };
  // all_to_all/all_gather as point-to-point messages. `pieces` (off, bytes) are the ranges of send to
  // stage (host-staged only); [own_from, own_from + own_bytes) of send is copied to own_to of recv
  // locally (skipped when it is already there).
  void exchange(const char* call, const Buffer& send, const Buffer& recv, const std::vector<Msg>& sends,
                const std::vector<Msg>& recvs, const std::vector<std::pair<int64_t, int64_t>>& pieces,
                int64_t own_from, int64_t own_to, int64_t own_bytes, const CallOptions& opts);
  // Throws RankMismatchError when a receive of an exchange got other than `expected` bytes from
  // `peer` (MPI_Testsome's status; `error_in_status`: it returned MPI_ERR_IN_STATUS).
  void check_received(const char* call, const MPI_Status& status, bool error_in_status, int peer,
                      int64_t expected);
  // Message size of the exchanges on `buf`: pipeline_chunk_bytes (staged copies then overlap the
  // transfers), whole messages (up to MPI's int count limit) for CUDA-aware device buffers or 0.
  int64_t piece_bytes(const Buffer& buf) const;
  // Host-staged element-wise collective in chunks: start_chunk(host_ptr, count, req) posts one chunk.
  void run_staged_chunked(const char* call, const Buffer& buf, bool copy_in, bool copy_out,
                          const std::function<int(void*, int64_t, MPI_Request*)>& start_chunk,
                          const CallOptions& opts);
  // The staging buffers, once the previous call's copy back no longer reads them (CUDA builds only).
  Staging& staging(int device, double deadline, const char* call, double timeout_s);
  // Waits, polling against `deadline`, until the work queued on the caller's stream is done, before
  // MPI reads device memory directly (CUDA builds only).
  void drain(const char* call, int device, const CallOptions& opts, double deadline);
  // Pinned staging buffer `which` (0: send, 1: recv) of at least `bytes` (CUDA builds only).
  char* reserve(Staging& st, int which, int64_t bytes, const char* call);
  // Polls `req` to completion; `bytes` in flight keep the poll from sleeping (backoff.h).
  void wait(const char* call, MPI_Request* req, int64_t bytes, double deadline, double timeout_s);
  void check(int rc, const char* call);
  // Makes the communicator unusable (the first reason is kept); `requests_left`: MPI requests of
  // the failed call are still pending, so MPI_Finalize is skipped at exit.
  void mark_broken(const std::string& reason, bool requests_left);
  // Throws when the communicator is broken, or called from a thread MPI's thread level forbids.
  void check_usable(const char* call) const;
  [[noreturn]] void timed_out(const char* call, double timeout_s);

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  bool cuda_aware_ = false;
  int thread_level_ = 0;  // MPI's, as initialized (by compcomm: what MPI_Init_thread provided)
  bool broken_ = false;  // a collective timed out or failed: the communicator is unusable
  std::atomic<bool> requests_left_{false};  // and gave up on requests still pending
  std::string broken_reason_;
  int64_t chunk_bytes_ = int64_t{1} << 20;
  BackoffPolicy policy_;  // the wait loops' (backoff.h); gentler when the node is oversubscribed
  std::unique_ptr<Staging> staging_;
  std::atomic<int64_t> staging_bytes_{0};  // the staging's size, readable while a call runs
  std::mutex mu_;  // one collective at a time per communicator (MPI needs the same order everywhere)
};

}  // namespace compcomm
