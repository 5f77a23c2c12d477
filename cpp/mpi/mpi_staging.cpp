// How the bytes of one collective move (MpiCommunicator::run, exchange, run_staged_chunked): host
// buffers and CUDA-aware device pointers go to MPI as they are; other device buffers are copied
// through the pinned staging buffers (mpi_staging.h) on the caller's stream, in pieces whose copies
// overlap MPI's transfers.
#include "mpi_staging.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <exception>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#ifdef COMPCOMM_MPI_CUDA
#include "../cuda_guard.h"
#endif
#include "backoff.h"

namespace compcomm {

#ifdef COMPCOMM_MPI_CUDA
namespace {
cudaStream_t stream_of(const CallOptions& opts) { return static_cast<cudaStream_t>(opts.stream); }

// Whether the work recorded before `ev` has finished; throws on a CUDA error.
bool event_ready(cudaEvent_t ev, const char* call, int rank) {
  const cudaError_t e = cudaEventQuery(ev);
  if (e == cudaSuccess) return true;
  if (e != cudaErrorNotReady) check_cuda(e, {"mpi", call, rank}, "cudaEventQuery");
  return false;
}
}  // namespace
#endif  // COMPCOMM_MPI_CUDA

#ifdef COMPCOMM_MPI_CUDA
MpiCommunicator::Staging& MpiCommunicator::staging(int device, double deadline, const char* call,
                                                   double timeout_s) {
  const CudaCallSite where{"mpi", call, rank_};
  if (!staging_) staging_ = std::make_unique<Staging>();
  Staging& st = *staging_;
  if (st.done)  // the previous call's copy back reads the staging buffers until this event fires
    poll_until(
        policy_, deadline, 0, [&](bool*) { return event_ready(st.done, call, rank_); },
        [&] { timed_out(call, timeout_s); });
  if (st.device != device) {  // events belong to a device
    st.release_events();
    st.device = device;
  }
  if (!st.done) COMPCOMM_CHECK_CUDA(cudaEventCreateWithFlags(&st.done, cudaEventDisableTiming), where);
  return st;
}
#endif

#ifdef COMPCOMM_MPI_CUDA
void MpiCommunicator::drain(const char* call, int device, const CallOptions& opts, double deadline) {
  // An event polled against the deadline, not cudaStreamSynchronize: a stream that never drains (it
  // waits on a hung collective of another library) raises TimeoutError too.
  const CudaCallSite where{"mpi", call, rank_};
  Staging& st = staging(device, deadline, call, opts.timeout_s);
  COMPCOMM_CHECK_CUDA(cudaEventRecord(st.done, stream_of(opts)), where);
  poll_until(
      policy_, deadline, 0, [&](bool*) { return event_ready(st.done, call, rank_); },
      [&] { timed_out(call, opts.timeout_s); });
}

char* MpiCommunicator::reserve(Staging& st, int which, int64_t bytes, const char* call) {
  const CudaCallSite where{"mpi", call, rank_};
  if (st.capacity[which] < bytes) {  // grown by half at least, so slowly growing sizes rarely realloc
    const int64_t grown = std::max<int64_t>(bytes, st.capacity[which] * 3 / 2);
    if (st.host[which]) COMPCOMM_CHECK_CUDA(cudaFreeHost(st.host[which]), where);
    st.host[which] = nullptr;
    staging_bytes_ -= st.capacity[which];
    st.capacity[which] = 0;
    COMPCOMM_CHECK_CUDA(cudaHostAlloc(&st.host[which], static_cast<size_t>(grown), cudaHostAllocPortable),
                        where);
    st.capacity[which] = grown;
    staging_bytes_ += grown;
  }
  return static_cast<char*>(st.host[which]);
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
      QuietDeviceGuard guard(recv.device);
      drain(call, recv.device, opts, deadline);
#endif
    }
    check(start(in_place ? nullptr : send.data, recv.data, &req), call);
    wait(call, &req, std::max(send_bytes, recv_bytes), deadline, opts.timeout_s);
    return;
  }
#ifdef COMPCOMM_MPI_CUDA
  // Host-staged: send goes to staging (at its in-place offset in the recv region when MPI supports it,
  // which saves a second buffer), MPI runs on host memory, recv is copied back on the stream.
  QuietDeviceGuard guard(recv.device);
  const CudaCallSite where{"mpi", call, rank_};
  cudaStream_t stream = stream_of(opts);
  Staging& st = staging(recv.device, deadline, call, opts.timeout_s);
  const bool stage_in_place = in_place_offset >= 0;
  const int64_t region = stage_in_place ? std::max(recv_bytes, in_place_offset + send_bytes) : recv_bytes;
  char* r = reserve(st, 1, region, call);
  char* s = stage_in_place ? r + in_place_offset : reserve(st, 0, send_bytes, call);
  if (send_bytes > 0)
    COMPCOMM_CHECK_CUDA(cudaMemcpyAsync(s, send.data, static_cast<size_t>(send_bytes), cudaMemcpyDeviceToHost,
                                        stream), where);
  COMPCOMM_CHECK_CUDA(cudaEventRecord(st.done, stream), where);
  poll_until(
      policy_, deadline, send_bytes, [&](bool*) { return event_ready(st.done, call, rank_); },
      [&] { timed_out(call, opts.timeout_s); });
  check(start(stage_in_place ? nullptr : s, r, &req), call);
  wait(call, &req, std::max(send_bytes, recv_bytes), deadline, opts.timeout_s);
  if (recv_bytes > 0)
    COMPCOMM_CHECK_CUDA(cudaMemcpyAsync(recv.data, r, static_cast<size_t>(recv_bytes), cudaMemcpyHostToDevice,
                                        stream), where);
  COMPCOMM_CHECK_CUDA(cudaEventRecord(st.done, stream), where);
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

void MpiCommunicator::check_received(const char* call, const MPI_Status& status, bool error_in_status,
                                     int peer, int64_t expected) {
  // A message shorter than the receive posted for it completes normally, a longer one fails with
  // MPI_ERR_TRUNCATE: either way the ranks disagree on the sizes or on how the exchange is split.
  int cls = MPI_SUCCESS, got = -1;
  if (error_in_status && status.MPI_ERROR != MPI_SUCCESS) MPI_Error_class(status.MPI_ERROR, &cls);
  if (cls == MPI_SUCCESS) {
    MPI_Get_count(&status, MPI_BYTE, &got);
    if (got == expected) return;
  } else if (cls != MPI_ERR_TRUNCATE) {
    check(status.MPI_ERROR, call);
  }
  mark_broken(detail::concat(call, " got a message of another size"), false);
  const std::string size = got >= 0 ? detail::concat(got, " bytes") : std::string("more bytes");
  throw RankMismatchError(
      detail::concat("[rank ", rank_, "] mpi ", call, ": a message from rank ", peer, " held ", size, " where ",
                     expected, " were expected: the ranks passed buffers of different sizes, or split the "
                     "exchange differently (pipeline_chunk_bytes, or CUDA-aware against host buffers, differs "
                     "between ranks)"),
      call, "mpi", 0, rank_);
}

void MpiCommunicator::exchange(const char* call, const Buffer& send, const Buffer& recv,
                               const std::vector<Msg>& sends, const std::vector<Msg>& recvs,
                               const std::vector<std::pair<int64_t, int64_t>>& pieces, int64_t own_from,
                               int64_t own_to, int64_t own_bytes, const CallOptions& opts) {
  constexpr int kTag = 0x6363;  // messages between two ranks match in posting order; one tag will do
  check_usable(call);
  const double deadline = now_s() + opts.timeout_s;
  const size_t nr = recvs.size(), n = nr + sends.size();
  std::vector<MPI_Request> reqs(n, MPI_REQUEST_NULL);  // recvs, then sends
  // Whatever ends this call early (a timeout, an MPI or CUDA error) leaves the communicator broken,
  // and a pending receive should not write into the caller's memory after we return: cancel each and
  // wait for the cancel (local for receives) -- at most about a second, since a receive already
  // matched to a message of a hung peer never completes; pending sends only read: released.
  struct Abandon {
    MpiCommunicator* self;
    std::vector<MPI_Request>& reqs;
    size_t nr;
    const char* call;
    int unwinding = std::uncaught_exceptions();
    ~Abandon() {
      if (std::uncaught_exceptions() == unwinding) return;  // normal return: all completed
      bool left = false;
      for (size_t i = 0; i < reqs.size(); ++i) {
        if (reqs[i] == MPI_REQUEST_NULL) continue;
        int flag = 0;
        if (i < nr) {
          MPI_Cancel(&reqs[i]);
          const double until = now_s() + 1.0;
          while (MPI_Test(&reqs[i], &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && !flag && now_s() < until)
            std::this_thread::yield();
        } else {
          MPI_Test(&reqs[i], &flag, MPI_STATUS_IGNORE);
        }
        if (flag) continue;
        MPI_Request_free(&reqs[i]);
        left = true;
      }
      self->mark_broken(detail::concat(call, " failed"), left);
    }
  } abandon{this, reqs, nr, call};
  std::vector<int> done_idx(n);
  int64_t bytes = 0;
  for (const Msg& m : recvs) bytes += m.bytes;
  const char* own_src = static_cast<const char*>(send.data) + own_from;
  char* own_dst = static_cast<char*>(recv.data) + own_to;
  const bool staged = !recv.on_host() && !cuda_aware_;
  auto post_recvs = [&](char* base) {
    for (size_t i = 0; i < nr; ++i)
      check(MPI_Irecv(base + recvs[i].off, static_cast<int>(recvs[i].bytes), MPI_BYTE, recvs[i].peer, kTag,
                      comm_, &reqs[i]),
            call);
  };
  auto post_send = [&](const char* base, size_t i) {
    check(MPI_Isend(base + sends[i].off, static_cast<int>(sends[i].bytes), MPI_BYTE, sends[i].peer, kTag, comm_,
                    &reqs[nr + i]),
          call);
  };
  // Completions in any order; `landed(i)` sees each finished receive once, of the size posted.
  std::vector<MPI_Status> statuses(n);
  size_t finished = 0;
  auto test = [&](bool* progress, auto&& landed) {
    int count = 0;
    const int rc = MPI_Testsome(static_cast<int>(n), reqs.data(), &count, done_idx.data(), statuses.data());
    if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) check(rc, call);
    if (count == MPI_UNDEFINED || count == 0) return;
    for (int k = 0; k < count; ++k)
      if (static_cast<size_t>(done_idx[k]) < nr)
        check_received(call, statuses[static_cast<size_t>(k)], rc == MPI_ERR_IN_STATUS,
                       recvs[static_cast<size_t>(done_idx[k])].peer, recvs[static_cast<size_t>(done_idx[k])].bytes);
    check(rc, call);  // a send's error
    *progress = true;
    finished += static_cast<size_t>(count);
    for (int k = 0; k < count; ++k)
      if (static_cast<size_t>(done_idx[k]) < nr) landed(static_cast<size_t>(done_idx[k]));
  };

  if (!staged) {
    if (!recv.on_host()) {
#ifdef COMPCOMM_MPI_CUDA
      QuietDeviceGuard guard(recv.device);
      const CudaCallSite where{"mpi", call, rank_};
      drain(call, recv.device, opts, deadline);
      if (own_bytes > 0 && own_src != own_dst)  // on the stream: the caller's next work reads it
        COMPCOMM_CHECK_CUDA(cudaMemcpyAsync(own_dst, own_src, static_cast<size_t>(own_bytes),
                                            cudaMemcpyDeviceToDevice, stream_of(opts)),
                            where);
#endif
    } else if (own_bytes > 0 && own_src != own_dst) {
      std::memcpy(own_dst, own_src, static_cast<size_t>(own_bytes));
    }
    post_recvs(static_cast<char*>(recv.data));
    for (size_t i = 0; i < sends.size(); ++i) post_send(static_cast<const char*>(send.data), i);
    poll_until(
        policy_, deadline, bytes,
        [&](bool* progress) {
          test(progress, [](size_t) {});
          return finished == n;
        },
        [&] { timed_out(call, opts.timeout_s); });
    return;
  }
#ifdef COMPCOMM_MPI_CUDA
  // Host-staged: what goes out is copied to the host on the stream; once it is there (an event,
  // polled against the deadline) the messages move between the staging buffers as between host
  // buffers, and then each received one is copied back on the stream. Sending each piece as soon as
  // its copy landed, and copying each message back as it arrived, made an all_to_all of 8 MiB on
  // two ranks at 1 Gbit/s take 49-67 ms where the same exchange staged by hand this way took 35 ms,
  // as on host memory (bench/diag_mpi_staging.py); the copies take well under a millisecond.
  QuietDeviceGuard guard(recv.device);
  const CudaCallSite where{"mpi", call, rank_};
  cudaStream_t stream = stream_of(opts);
  Staging& st = staging(recv.device, deadline, call, opts.timeout_s);
  char* hs = reserve(st, 0, send.bytes(), call);
  char* hr = reserve(st, 1, recv.bytes(), call);
  for (const auto& [off, len] : pieces)
    COMPCOMM_CHECK_CUDA(cudaMemcpyAsync(hs + off, static_cast<const char*>(send.data) + off,
                                        static_cast<size_t>(len), cudaMemcpyDeviceToHost, stream), where);
  if (own_bytes > 0 && own_src != own_dst)
    COMPCOMM_CHECK_CUDA(cudaMemcpyAsync(own_dst, own_src, static_cast<size_t>(own_bytes),
                                        cudaMemcpyDeviceToDevice, stream), where);
  COMPCOMM_CHECK_CUDA(cudaEventRecord(st.done, stream), where);
  poll_until(
      policy_, deadline, 0, [&](bool*) { return event_ready(st.done, call, rank_); },
      [&] { timed_out(call, opts.timeout_s); });
  post_recvs(hr);
  for (size_t i = 0; i < sends.size(); ++i) post_send(hs, i);
  poll_until(
      policy_, deadline, bytes,
      [&](bool* progress) {
        test(progress, [](size_t) {});
        return finished == n;
      },
      [&] { timed_out(call, opts.timeout_s); });
  for (const Msg& m : recvs)
    COMPCOMM_CHECK_CUDA(cudaMemcpyAsync(static_cast<char*>(recv.data) + m.off, hr + m.off,
                                        static_cast<size_t>(m.bytes), cudaMemcpyHostToDevice, stream),
                        where);
  COMPCOMM_CHECK_CUDA(cudaEventRecord(st.done, stream), where);
#else
  (void)pieces;
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
  QuietDeviceGuard guard(buf.device);
  const CudaCallSite where{"mpi", call, rank_};
  cudaStream_t stream = stream_of(opts);
  const int64_t esize = static_cast<int64_t>(dtype_size(buf.dtype));
  // elements per chunk: MPI counts are ints
  const int64_t per = std::min<int64_t>(
      INT_MAX, chunk_bytes_ > 0 ? std::max<int64_t>(1, chunk_bytes_ / esize) : std::max<int64_t>(1, buf.count));
  const int64_t nchunks = buf.count == 0 ? 0 : (buf.count + per - 1) / per;
  Staging& st = staging(buf.device, deadline, call, opts.timeout_s);
  char* host = reserve(st, 1, buf.bytes(), call);
  while (static_cast<int64_t>(st.events.size()) < nchunks) {
    cudaEvent_t e;
    COMPCOMM_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), where);
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
                                          cudaMemcpyDeviceToHost, stream), where);
      COMPCOMM_CHECK_CUDA(cudaEventRecord(st.events[i], stream), where);
    }
  std::vector<MPI_Request> reqs(static_cast<size_t>(nchunks), MPI_REQUEST_NULL);
  int64_t posted = 0, finished = 0;
  // An error with chunks in flight (a failed copy back): their requests still use the staging memory,
  // which only a broken communicator keeps for good (see the destructor).
  struct InFlight {
    MpiCommunicator* self;
    const int64_t &posted, &finished;
    const char* call;
    int unwinding = std::uncaught_exceptions();
    ~InFlight() {
      if (std::uncaught_exceptions() != unwinding && posted > finished)
        self->mark_broken(detail::concat(call, " failed"), true);
    }
  } in_flight{this, posted, finished, call};
  poll_until(
      policy_, deadline, buf.bytes(),
      [&](bool* progress) {
        while (posted < nchunks && (!copy_in || event_ready(st.events[posted], call, rank_))) {
          int64_t off, n;
          chunk(posted, &off, &n);
          check(start_chunk(host + off * esize, n, &reqs[posted]), call);
          ++posted;
          *progress = true;
        }
        // Copied back in order, so only the oldest posted chunk is tested.
        while (finished < posted) {
          int flag = 0;
          check(MPI_Test(&reqs[finished], &flag, MPI_STATUS_IGNORE), call);
          if (!flag) break;
          if (copy_out) {
            int64_t off, n;
            chunk(finished, &off, &n);
            COMPCOMM_CHECK_CUDA(cudaMemcpyAsync(dev + off * esize, host + off * esize,
                                                static_cast<size_t>(n * esize), cudaMemcpyHostToDevice, stream),
                                where);
          }
          ++finished;
          *progress = true;
        }
        return finished == nchunks;
      },
      [&] { timed_out(call, opts.timeout_s); });
  COMPCOMM_CHECK_CUDA(cudaEventRecord(st.done, stream), where);
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

}  // namespace compcomm
