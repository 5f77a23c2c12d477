// Types shared by every layer of the core: dtypes, buffer views, call options and the error family.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <type_traits>
#include <stdexcept>
#include <string>

namespace compcomm {

enum class DType : int32_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kUInt8 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kFloat64 = 6,
};

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);

enum class ReduceOp : int32_t { kSum = 0, kMax = 1, kMin = 2 };

// A view of memory owned by the caller: host memory when device < 0, else CUDA device `device`.
struct Buffer {
  void* data = nullptr;
  int64_t count = 0;
  DType dtype = DType::kUInt8;
  int device = -1;

  int64_t bytes() const { return count * static_cast<int64_t>(dtype_size(dtype)); }
  bool on_host() const { return device < 0; }
  // Elements [offset, offset + n) as a view of the same memory.
  Buffer slice(int64_t offset, int64_t n) const;
  // The same bytes seen as `n` elements of `t` starting `byte_offset` bytes in.
  Buffer reinterpret(DType t, int64_t byte_offset, int64_t n) const;
};

// Per-call options: how long a collective may wait and on which CUDA stream device work runs.
struct CallOptions {
  double timeout_s = 600.0;
  void* stream = nullptr;  // cudaStream_t; ignored for host buffers
  // compressed_allreduce on device buffers: copy the exchanged headers to the host and validate them
  // (one small stream sync). false: no host sync (CUDA-graph capturable); see compressed_allreduce.h.
  bool check = true;
  // The commit of a split compressed call: read the communicator's abort flag first and write
  // nothing once it is set (Communicator::abort_flag). false: the caller waited for the exchange's
  // device work and found no abort, so the data is complete and a later abort must not skip it.
  bool gate = true;
};

// The error family. Each error carries the failing call, the backend and its code, and the rank.
// Bindings map each class to the Python class of the same role in compcomm.errors.
class Error : public std::runtime_error {
 public:
  Error(const std::string& message, std::string call = "", std::string backend = "", int code = 0,
        int rank = -1)
      : std::runtime_error(message),
        call_(std::move(call)),
        backend_(std::move(backend)),
        code_(code),
        rank_(rank) {}
  const std::string& call() const { return call_; }
  const std::string& backend() const { return backend_; }
  int code() const { return code_; }
  int rank() const { return rank_; }

 private:
  std::string call_, backend_;
  int code_, rank_;
};

// A communication library call failed (NCCL, MPI, CUDA, or the torch process group).
class BackendError : public Error {
  using Error::Error;
};
// A collective did not complete before its deadline.
class TimeoutError : public Error {
  using Error::Error;
};
// Ranks called a collective with different sizes or dtypes.
class RankMismatchError : public Error {
  using Error::Error;
};
// A tensor or error buffer held NaN or Inf.
class NonFiniteError : public Error {
  using Error::Error;
};
// A bad argument (maps to ValueError); the message names the argument.
class InvalidArgument : public std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
// The build or the machine lacks what the call needs (CUDA, NCCL, MPI).
class Unsupported : public Error {
  using Error::Error;
};

namespace detail {
// Message building without iostreams: where the extension ends up with its own (static) copy of
// libstdc++ next to the process's shared one (seen on the GPU machine's toolchain), the iostream locale
// facets of the two copies clash and any ostringstream use crashes.
inline void append(std::string& s, const char* v) { s += v ? v : "(null)"; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T>
void append(std::string& s, const T& v) {
  if constexpr (std::is_floating_point_v<T>) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
    s += buf;
  } else if constexpr (std::is_enum_v<T>) {
    s += std::to_string(static_cast<long long>(v));
  } else if constexpr (std::is_pointer_v<T>) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%p", static_cast<const void*>(v));
    s += buf;
  } else {
    s += std::to_string(v);
  }
}
template <typename... Args>
std::string concat(Args&&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}
}  // namespace detail

}  // namespace compcomm

#define COMPCOMM_CHECK(cond, ...)                                                      \
  do {                                                                                 \
    if (!(cond)) throw ::compcomm::InvalidArgument(::compcomm::detail::concat(__VA_ARGS__)); \
  } while (0)
