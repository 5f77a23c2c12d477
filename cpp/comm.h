// The one backend interface. Algorithms (compressed allreduce, bucketed collectives) are written
// against Communicator; a backend (local, torch process group, MPI, NCCL) implements the do_* methods
// and nothing else.
//
// The public methods are non-virtual: they check sizes, count the bytes this rank puts on the wire and
// then call the backend. Byte counts follow nccl-tests' conventions for ring algorithms: all_to_all and
// reduce_scatter send (W-1)/W of the input, all_gather sends (W-1) pieces of its input, all_reduce
// 2(W-1)/W of the buffer, broadcast the buffer once.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "common.h"

namespace compcomm {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Short backend name for messages: "local", "torch:gloo", "mpi", "nccl".
  virtual std::string backend_name() const = 0;

  // send has size()*b bytes; bytes [j*b, (j+1)*b) go to rank j, landing at [rank()*b, ...) of its recv.
  void all_to_all(const Buffer& send, const Buffer& recv, const CallOptions& opts);
  // recv (size()*|send| bytes) = concatenation over ranks of send.
  void all_gather(const Buffer& send, const Buffer& recv, const CallOptions& opts);
  // recv (|send|/size() elements) = op over ranks of send's chunk rank().
  void reduce_scatter(const Buffer& send, const Buffer& recv, ReduceOp op, const CallOptions& opts);
  // buf = op over ranks of buf, in place.
  void all_reduce(const Buffer& buf, ReduceOp op, const CallOptions& opts);
  // buf = root's buf on every rank.
  void broadcast(const Buffer& buf, int root, const CallOptions& opts);
  // Returns once every rank has entered.
  void barrier(const CallOptions& opts);

  // Bytes this rank has sent through this communicator (see the conventions above).
  int64_t bytes_sent() const { return bytes_sent_; }
  void reset_bytes_sent() { bytes_sent_ = 0; }
  // Unique over the process's lifetime (unlike the address, which a later communicator may reuse).
  uint64_t id() const { return id_; }
  // Throws the error that closed this communicator if something closed it asynchronously (NCCL: the
  // timeout watchdog, whose abort ends the device work of earlier calls without their data); a
  // no-op for backends whose calls complete or fail on the host. An algorithm that waited on the
  // host for earlier calls' device work calls it before reading what they received.
  void check_open(const char* call) { do_check_open(call); }
  // Address of an int that becomes nonzero before this communicator cancels work it already
  // enqueued (NCCL: before ncclCommAbort releases the kernels of collectives that never completed,
  // whose receive buffers then hold garbage); readable where the call's buffers live (NCCL: mapped
  // host memory, read by a kernel). The commit of the 1-bit algorithms reads it in stream order
  // (kernels::commit_gate) and writes nothing once it is set. nullptr (the default): this backend's
  // calls complete or fail on the host, so nothing after them can see data that never arrived.
  const int* abort_flag() const { return do_abort_flag(); }
  // True for a world of one rank whose collectives on buffers of `device` (-1: host) would only
  // copy send to recv on the caller's stream (nothing to wait for, nothing a peer can cancel, no
  // argument error): an algorithm may then skip the collectives whose send and recv are the same
  // memory. False unless the backend says so (do_alone), so a subclass that counts, fails or
  // cancels its collectives still sees every one.
  bool alone(int device) const { return size() == 1 && do_alone(device); }
  // True once a call gave up on transfers still in progress (MPI after a timeout: such transfers
  // cannot be cancelled), which may still read or write that call's buffers: their memory must never
  // be freed (the Python bindings keep the buffers' objects). False for backends whose failed calls
  // leave nothing running.
  bool requests_left() const { return do_requests_left(); }
  // Empty when any thread may call this communicator; otherwise why only one thread may (MPI
  // initialized below MPI_THREAD_MULTIPLE). AsyncComm, whose worker thread calls it, refuses those.
  std::string thread_restriction() const { return do_thread_restriction(); }

 protected:
  virtual void do_all_to_all(const Buffer& send, const Buffer& recv, const CallOptions& opts) = 0;
  virtual void do_all_gather(const Buffer& send, const Buffer& recv, const CallOptions& opts) = 0;
  virtual void do_reduce_scatter(const Buffer& send, const Buffer& recv, ReduceOp op,
                                 const CallOptions& opts) = 0;
  virtual void do_all_reduce(const Buffer& buf, ReduceOp op, const CallOptions& opts) = 0;
  virtual void do_broadcast(const Buffer& buf, int root, const CallOptions& opts) = 0;
  virtual void do_barrier(const CallOptions& opts) = 0;
  virtual void do_check_open(const char* /*call*/) {}
  virtual const int* do_abort_flag() const { return nullptr; }
  virtual bool do_alone(int /*device*/) const { return false; }
  virtual bool do_requests_left() const { return false; }
  virtual std::string do_thread_restriction() const { return ""; }

 private:
  std::atomic<int64_t> bytes_sent_{0};  // a ZeRO bucket thread and the caller may both count
  uint64_t id_ = next_id();
  static uint64_t next_id();
};

}  // namespace compcomm
