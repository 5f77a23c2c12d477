// 1-bit compressed allreduce with error feedback (DeepSpeed's algorithm, ONEBIT_SPEC.md section a),
// written once against Communicator.
#pragma once

#include <cstdint>
#include <vector>

#include "comm.h"

namespace compcomm {

// Where each piece lives in the caller-owned workspace (byte offsets, each 256-byte aligned).
struct CompressedAllreduceLayout {
  int64_t header_send, header_recv;    // one Header per rank
  int64_t signs_send, signs_recv;      // P/8 bytes each
  int64_t record_send, record_recv;    // one Record per rank: server scale + packed server signs
                                       // (record_recv aliases signs_send)
  int64_t scratch;                     // kernel scratch (scale reductions on GPU); always at offset 0
  int64_t record_bytes;                // bytes of one Record
  int64_t record_scale_bytes;          // where a Record's packed signs start (after the fp32 scale)
  int64_t total;                       // workspace bytes needed
};

CompressedAllreduceLayout compressed_allreduce_layout(int64_t padded, int world, bool cuda);

// Tests: the host address of this thread's notice (compressed_allreduce.cpp, NoticeSlot) for host
// (cuda = false) or device calls, made if there is none; 0 where mapped memory cannot be had.
uint64_t notice_address(bool cuda);

// Bytes one rank sends in one call (the same count Communicator::bytes_sent accumulates).
int64_t compressed_allreduce_wire_bytes(int64_t padded, int world);

// tensor: n elements of fp32/fp16/bf16; worker_error: P fp32; server_error: P/W fp32; all on one
// device. On return, tensor holds the compressed average (identical on all ranks) and both errors are
// updated. Transactional: if any rank's sizes differ, any rank's input is not finite, or a collective
// fails, the call throws and tensor and both errors are left as they were.
//
// On device buffers the headers and records live in the (device) workspace and no scale leaves the
// device. opts.check = true copies the gathered headers to the host and validates them as on the CPU
// (one small stream sync per call; a whole call alone on one rank instead waits only for the worker
// kernel's header, posted to mapped host memory, for at most opts.timeout_s, and queues the commit
// after it: no sync, and a raising call wrote nothing). opts.check = false never syncs (the call can be captured in a CUDA
// graph): sizes are still validated on the host the first time a (communicator, numel, padded, dtype)
// is seen, and afterwards a call in which any rank's scale is not finite leaves every rank's state
// unchanged without raising. Host buffers are always checked (it costs nothing there). On every
// backend, checked or not, a server scale that is not finite although the inputs were (an overflow
// of the server's sum) makes the commit write nothing, without raising.
void compressed_allreduce(Communicator& comm, const Buffer& tensor, const Buffer& worker_error,
                          const Buffer& server_error, const Buffer& workspace, const CallOptions& opts);

// The 1-bit compressed reduce-scatter: the compressed allreduce without its final all-gather
// (phase 1 + server compression). Same inputs, padding rule and error-feedback updates as
// compressed_allreduce; the workspace is sized by compressed_allreduce_layout. On return, `out`
// (P/W fp32 elements) holds this rank's chunk of the compressed average, tau_r * s(c_r) -- exactly
// chunk r of what compressed_allreduce would have returned -- and tensor holds that chunk at its
// positions [r*C, (r+1)*C) (where < n) and +0 elsewhere. worker_error and server_error are updated
// as by compressed_allreduce. Transactional like compressed_allreduce. Host or device buffers.
void compressed_reduce_scatter(Communicator& comm, const Buffer& tensor, const Buffer& worker_error,
                               const Buffer& server_error, const Buffer& out, const Buffer& workspace,
                               const CallOptions& opts);

// The same call in two halves, so that several buckets can be exchanged (during backward) and then
// committed together or not at all (ZeRO's overlapped 1-bit steps). The exchange does every
// collective and validation (raising, on every rank, what compressed_reduce_scatter would) and
// writes only the workspace; the commit, called later with the same arguments and the untouched
// workspace, does the local writes of tensor, worker_error, server_error and out. Always checked on
// the host (opts.check is ignored).
void compressed_reduce_scatter_exchange(Communicator& comm, const Buffer& tensor, const Buffer& worker_error,
                                        const Buffer& server_error, const Buffer& out, const Buffer& workspace,
                                        const CallOptions& opts);
void compressed_reduce_scatter_commit(Communicator& comm, const Buffer& tensor, const Buffer& worker_error,
                                      const Buffer& server_error, const Buffer& out, const Buffer& workspace,
                                      const CallOptions& opts);

// The compressed allreduce in the same two halves (the 1-bit optimizers' buckets: every bucket of a
// step exchanged, pipelined with the staging of the next, then all committed or none). Same contract
// as the reduce-scatter pair above; always checked on the host.
void compressed_allreduce_exchange(Communicator& comm, const Buffer& tensor, const Buffer& worker_error,
                                   const Buffer& server_error, const Buffer& workspace, const CallOptions& opts);
void compressed_allreduce_commit(Communicator& comm, const Buffer& tensor, const Buffer& worker_error,
                                 const Buffer& server_error, const Buffer& workspace, const CallOptions& opts);

// Bytes one rank sends in one compressed_reduce_scatter call.
int64_t compressed_reduce_scatter_wire_bytes(int64_t padded, int world);

// Several compressed allreduce exchanges in three collectives instead of three per call (the
// buckets of one optimizer step): the same local steps on each call's own workspace, then each call
// is committed with compressed_allreduce_commit, bit for bit as after per-call exchanges. Every rank
// passes the same number of calls with the same sizes (a size or dtype that differs is reported as
// by compressed_allreduce, on every rank, before anything but the workspaces is written; a number of
// calls that differs, zero included, raises RankMismatchError naming each rank's count: the counts
// go first, in an all_gather of one 32-byte record per rank, which also tells a single call or a layout
// check of compcomm._agree met in its place). `staging` (on the tensors' device) holds
// compressed_allreduce_batch_bytes(paddeds, world) bytes. Always checked on the host (opts.check is
// ignored); on device buffers that costs two stream syncs per batch (the counts, then all headers).
int64_t compressed_allreduce_batch_bytes(const std::vector<int64_t>& paddeds, int world);
void compressed_allreduce_exchange_many(Communicator& comm, const std::vector<Buffer>& tensors,
                                        const std::vector<Buffer>& worker_errors,
                                        const std::vector<Buffer>& server_errors,
                                        const std::vector<Buffer>& workspaces, const Buffer& staging,
                                        const CallOptions& opts);

// The same batching for compressed reduce-scatters (FSDP2's tensor-aligned segments): the headers
// and the signs of every call in one collective each (three with the call count), no records
// travel; each call is then committed with compressed_reduce_scatter_commit (its `outs[i]`), bit
// for bit as after per-call exchanges. Staging: compressed_allreduce_batch_bytes.
void compressed_reduce_scatter_exchange_many(Communicator& comm, const std::vector<Buffer>& tensors,
                                             const std::vector<Buffer>& worker_errors,
                                             const std::vector<Buffer>& server_errors,
                                             const std::vector<Buffer>& outs,
                                             const std::vector<Buffer>& workspaces, const Buffer& staging,
                                             const CallOptions& opts);

// compressed_allreduce_commit of every call of one compressed_allreduce_exchange_many (or of
// per-call exchanges), in order, bit for bit; on a GPU in O(1) launches instead of two per call. All
// arguments are validated before anything is written (a bad one raises as compressed_allreduce_commit
// would, and no call is committed).
void compressed_allreduce_commit_many(Communicator& comm, const std::vector<Buffer>& tensors,
                                      const std::vector<Buffer>& worker_errors,
                                      const std::vector<Buffer>& server_errors,
                                      const std::vector<Buffer>& workspaces, const CallOptions& opts);

}  // namespace compcomm
