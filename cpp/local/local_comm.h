// A world of one rank: every collective is a copy (or nothing). Needs no network, so single-process
// runs and C++ tests use the same algorithm code as multi-rank runs.
#pragma once

#include "../comm.h"

namespace compcomm {

class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend_name() const override { return "local"; }

 protected:
  void do_all_to_all(const Buffer& send, const Buffer& recv, const CallOptions& opts) override;
  void do_all_gather(const Buffer& send, const Buffer& recv, const CallOptions& opts) override;
  void do_reduce_scatter(const Buffer& send, const Buffer& recv, ReduceOp op,
                         const CallOptions& opts) override;
  void do_all_reduce(const Buffer&, ReduceOp, const CallOptions&) override {}
  void do_broadcast(const Buffer&, int, const CallOptions&) override {}
  void do_barrier(const CallOptions&) override {}
  bool do_alone(int) const override { return true; }
};

// Copies `bytes` bytes between buffers on the same device (host memcpy or a CUDA copy on the stream).
void copy_bytes(const Buffer& dst, const Buffer& src, int64_t bytes, const CallOptions& opts);

}  // namespace compcomm
