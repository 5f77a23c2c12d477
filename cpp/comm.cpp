#include "comm.h"

#include <atomic>

namespace compcomm {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kUInt8: return 1;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kFloat64: return 8;
  }
  throw InvalidArgument("unknown dtype code " + std::to_string(static_cast<int>(dtype)));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kUInt8: return "uint8";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kFloat64: return "float64";
  }
  return "unknown";
}

Buffer Buffer::slice(int64_t offset, int64_t n) const {
  Buffer b = *this;
  b.data = static_cast<char*>(data) + offset * static_cast<int64_t>(dtype_size(dtype));
  b.count = n;
  return b;
}

Buffer Buffer::reinterpret(DType t, int64_t byte_offset, int64_t n) const {
  Buffer b;
  b.data = static_cast<char*>(data) + byte_offset;
  b.count = n;
  b.dtype = t;
  b.device = device;
  return b;
}

namespace {
void check_pair(const char* call, const Buffer& a, const Buffer& b) {
  COMPCOMM_CHECK(a.device == b.device, call, ": send and recv are on different devices (", a.device,
                 " vs ", b.device, ")");
}
}  // namespace

void Communicator::all_to_all(const Buffer& send, const Buffer& recv, const CallOptions& opts) {
  check_pair("all_to_all", send, recv);
  COMPCOMM_CHECK(send.bytes() == recv.bytes() && send.bytes() % size() == 0,
                 "all_to_all: send and recv must have equal sizes divisible by the world size ",
                 size(), " (got ", send.bytes(), " and ", recv.bytes(), " bytes)");
  bytes_sent_ += send.bytes() / size() * (size() - 1);
  do_all_to_all(send, recv, opts);
}

void Communicator::all_gather(const Buffer& send, const Buffer& recv, const CallOptions& opts) {
  check_pair("all_gather", send, recv);
  COMPCOMM_CHECK(recv.bytes() == send.bytes() * size(), "all_gather: recv must hold world size ",
                 size(), " x send (", send.bytes(), " bytes), got ", recv.bytes());
  bytes_sent_ += send.bytes() * (size() - 1);
  do_all_gather(send, recv, opts);
}

void Communicator::reduce_scatter(const Buffer& send, const Buffer& recv, ReduceOp op,
                                  const CallOptions& opts) {
  check_pair("reduce_scatter", send, recv);
  COMPCOMM_CHECK(send.dtype == recv.dtype && send.count == recv.count * size(),
                 "reduce_scatter: send must hold world size ", size(), " x recv elements of the same dtype");
  bytes_sent_ += recv.bytes() * (size() - 1);
  do_reduce_scatter(send, recv, op, opts);
}

void Communicator::all_reduce(const Buffer& buf, ReduceOp op, const CallOptions& opts) {
  bytes_sent_ += 2 * buf.bytes() * (size() - 1) / size();
  do_all_reduce(buf, op, opts);
}

void Communicator::broadcast(const Buffer& buf, int root, const CallOptions& opts) {
  COMPCOMM_CHECK(root >= 0 && root < size(), "broadcast: root ", root, " is not a rank of a world of size ",
                 size());
  if (size() > 1) bytes_sent_ += buf.bytes();
  do_broadcast(buf, root, opts);
}

void Communicator::barrier(const CallOptions& opts) { do_barrier(opts); }

uint64_t Communicator::next_id() {
  static std::atomic<uint64_t> counter{0};
  return ++counter;
}

}  // namespace compcomm
