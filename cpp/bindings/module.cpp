// The extension module compcomm._C: exports only. Arguments arrive as Buffer views the Python layer
// built from validated torch tensors; the GIL is released around all work; C++ errors become the
// classes of compcomm.errors.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

#include "../comm.h"
#include "../compressed_allreduce.h"
#include "../kernels/kernels.h"
#include "../kernels/norms.h"
#include "../kernels/notice.h"
#include "../kernels/packed_momentum.h"
#include "../local/local_comm.h"
#include "build_info.h"
#include "call_keeping.h"

namespace py = pybind11;
using namespace compcomm;

#ifdef COMPCOMM_WITH_MPI
void bind_mpi(py::module_& m);  // mpi_bindings.cpp
#endif
#ifdef COMPCOMM_WITH_NCCL
void bind_nccl(py::module_& m);  // nccl_bindings.cpp
#endif
void bind_zero(py::module_& m);  // zero_bindings.cpp
void bind_optim_cuda(py::module_& m);  // optim_cuda_bindings.cpp
void bind_optim(py::module_& m);  // optim_bindings.cpp

namespace {

// Lets Python classes (the torch.distributed adapter) implement Communicator.
class PyCommunicator : public Communicator {
 public:
  // A communicator's rank and size never change: asked of Python once, then kept. (Every call of
  // the 1-bit algorithms asks for both, from worker threads that must take the GIL for it: several
  // microseconds per bucket of a batched step.)
  int rank() const override {
    int r = rank_.load(std::memory_order_relaxed);
    if (r < 0) rank_.store(r = py_rank(), std::memory_order_relaxed);
    return r;
  }
  int size() const override {
    int s = size_.load(std::memory_order_relaxed);
    if (s < 0) size_.store(s = py_size(), std::memory_order_relaxed);
    return s;
  }
  std::string backend_name() const override {
    PYBIND11_OVERRIDE_PURE(std::string, Communicator, backend_name);
  }

 protected:
  void do_all_to_all(const Buffer& send, const Buffer& recv, const CallOptions& opts) override {
    PYBIND11_OVERRIDE_PURE(void, Communicator, do_all_to_all, send, recv, opts);
  }
  void do_all_gather(const Buffer& send, const Buffer& recv, const CallOptions& opts) override {
    PYBIND11_OVERRIDE_PURE(void, Communicator, do_all_gather, send, recv, opts);
  }
  void do_reduce_scatter(const Buffer& send, const Buffer& recv, ReduceOp op,
                         const CallOptions& opts) override {
    PYBIND11_OVERRIDE_PURE(void, Communicator, do_reduce_scatter, send, recv, op, opts);
  }
  void do_all_reduce(const Buffer& buf, ReduceOp op, const CallOptions& opts) override {
    PYBIND11_OVERRIDE_PURE(void, Communicator, do_all_reduce, buf, op, opts);
  }
  void do_broadcast(const Buffer& buf, int root, const CallOptions& opts) override {
    PYBIND11_OVERRIDE_PURE(void, Communicator, do_broadcast, buf, root, opts);
  }
  void do_barrier(const CallOptions& opts) override {
    PYBIND11_OVERRIDE_PURE(void, Communicator, do_barrier, opts);
  }
  // Optional in Python: do_abort_flag(self) -> int, the flag's address (0: none). Asked once (the
  // address is the communicator's for its life; every bucket's commit asks for it).
  const int* do_abort_flag() const override {
    if (flag_asked_.load(std::memory_order_acquire)) return flag_.load(std::memory_order_relaxed);
    const int* flag = nullptr;
    {
      py::gil_scoped_acquire gil;
      py::function f = py::get_override(static_cast<const Communicator*>(this), "do_abort_flag");
      if (f) flag = reinterpret_cast<const int*>(f().cast<uintptr_t>());
    }
    flag_.store(flag, std::memory_order_relaxed);
    flag_asked_.store(true, std::memory_order_release);
    return flag;
  }

 private:
  int py_rank() const { PYBIND11_OVERRIDE_PURE(int, Communicator, rank); }
  int py_size() const { PYBIND11_OVERRIDE_PURE(int, Communicator, size); }
  // -1: not asked yet (a negative answer is asked again)
  mutable std::atomic<int> rank_{-1}, size_{-1};
  mutable std::atomic<bool> flag_asked_{false};
  mutable std::atomic<const int*> flag_{nullptr};
};

const char* buffer_format(DType t) {
  switch (t) {
    case DType::kFloat32: return "f";
    case DType::kFloat16: return "e";
    case DType::kBFloat16: return "H";  // no bfloat16 in the buffer protocol: raw 16-bit words
    case DType::kUInt8: return "B";
    case DType::kInt32: return "i";
    case DType::kInt64: return "q";
    case DType::kFloat64: return "d";
  }
  return "B";
}

const char* typestr(DType t) {
  switch (t) {
    case DType::kFloat32: return "<f4";
    case DType::kFloat16: return "<f2";
    case DType::kBFloat16: return "<u2";
    case DType::kUInt8: return "|u1";
    case DType::kInt32: return "<i4";
    case DType::kInt64: return "<i8";
    case DType::kFloat64: return "<f8";
  }
  return "|u1";
}

CallOptions options(double timeout_s, uintptr_t stream) {
  COMPCOMM_CHECK(timeout_s > 0, "timeout must be positive, got ", timeout_s);
  return CallOptions{timeout_s, reinterpret_cast<void*>(stream)};
}

// A kernel's status as an exception. kInvalidArgument: the kernel rejected an argument that the
// binding did not check first (the bindings below check what each kernel takes, naming the argument).
void check(kernels::Status s, const char* name) {
  if (s == kernels::Status::kSuccess) return;
  if (s == kernels::Status::kNotBuilt)
    throw Unsupported(std::string(name) + ": this build has no CUDA kernels", name, "cuda", 3, -1);
  if (s == kernels::Status::kInvalidArgument)
    throw InvalidArgument(std::string(name) +
                          ": the kernel rejected its arguments (a count, chunk, stride or world it does not take)");
  throw BackendError(std::string(name) + ": CUDA error", name, "cuda", static_cast<int>(s), -1);
}

kernels::InputType itype(const Buffer& b) {
  COMPCOMM_CHECK(b.dtype == DType::kFloat32 || b.dtype == DType::kFloat16 || b.dtype == DType::kBFloat16,
                 "input must be float32, float16 or bfloat16, got ", dtype_name(b.dtype));
  return static_cast<kernels::InputType>(b.dtype);
}

template <class T>
T* ptr(const Buffer& b) {
  return static_cast<T*>(b.data);
}

// ---- Argument checks of the _C.kernels bindings. The kernels trust their inputs, so each binding
// checks every buffer it passes: its dtype (TypeError), its size for the given counts, world and
// strides, and its device (ValueError), the message naming the argument. Sizes are compared in forms
// that cannot overflow (a product only after the division that bounds it). ----

std::string device_name(const Buffer& b) {
  return b.on_host() ? std::string("host") : "cuda:" + std::to_string(b.device);
}

[[noreturn]] void dtype_error(const char* fn, const char* name, const char* want, const Buffer& b) {
  throw py::type_error(compcomm::detail::concat(fn, ": ", name, " must be ", want, ", got ", dtype_name(b.dtype)));
}

void need_dtype(const char* fn, const char* name, const Buffer& b, DType t) {
  if (b.dtype != t) dtype_error(fn, name, dtype_name(t), b);
}

// The input tensor m of the worker kernels: fp32, fp16 or bf16.
kernels::InputType need_input(const char* fn, const char* name, const Buffer& b) {
  if (b.dtype != DType::kFloat32 && b.dtype != DType::kFloat16 && b.dtype != DType::kBFloat16)
    dtype_error(fn, name, "float32, float16 or bfloat16", b);
  return static_cast<kernels::InputType>(b.dtype);
}

// b.count >= n; `what` says where n comes from.
void need_count(const char* fn, const char* name, const Buffer& b, int64_t n, const char* what) {
  COMPCOMM_CHECK(b.count >= n, fn, ": ", name, " has ", b.count, " elements, needs ", n, " (", what, ")");
}

// `rows` runs of `len` elements, run i at element i * stride: stride >= 1 and
// (rows - 1) * stride + len <= b.count. rows >= 1.
void need_rows(const char* fn, const char* name, const Buffer& b, int rows, int64_t stride,
               const char* stride_name, int64_t len) {
  COMPCOMM_CHECK(stride >= 1, fn, ": ", stride_name, " must be >= 1, got ", stride);
  COMPCOMM_CHECK(b.count >= len && (rows <= 1 || (b.count - len) / (rows - 1) >= stride), fn, ": ", name,
                 " has ", b.count, " elements; world = ", rows, " rows of ", len, " at ", stride_name, " = ",
                 stride, " need (world - 1) * ", stride_name, " + ", len);
}

// One fp32 scale.
void need_scale(const char* fn, const char* name, const Buffer& b) {
  need_dtype(fn, name, b, DType::kFloat32);
  need_count(fn, name, b, 1, "one fp32 scale");
}

// The scratch a scale pass over `count` elements needs on the device of `ref`.
void need_scratch(const char* fn, const Buffer& ws, const Buffer& ref, int64_t count, const char* what) {
  const auto scratch = static_cast<int64_t>(ref.on_host() ? kernels::cpu::scale_workspace_bytes(count)
                                                          : kernels::cuda::scale_workspace_bytes(count));
  COMPCOMM_CHECK(ws.bytes() >= scratch, fn, ": workspace has ", ws.bytes(), " bytes, needs ", scratch,
                 " (scale_workspace_bytes(", what, "))");
}

void need_world(const char* fn, int world) {
  COMPCOMM_CHECK(world >= 1, fn, ": world must be >= 1, got ", world);
}

// A kernel runs where `ref` lives and dereferences every pointer there.
void same_device(const char* fn, const char* ref_name, const Buffer& ref,
                 std::initializer_list<std::pair<const char*, const Buffer*>> bufs) {
  for (const auto& [name, b] : bufs)
    COMPCOMM_CHECK(b->device == ref.device, fn, ": ", name, " must be on the device of ", ref_name, " (",
                   device_name(ref), "), got ", device_name(*b));
}

// The optional guard of the commit kernels: `world` fp32 scales at guard_stride, on ref's device.
void check_guard(const char* fn, const std::optional<Buffer>& guard, int64_t guard_stride, int world,
                 const char* ref_name, const Buffer& ref) {
  if (!guard) return;
  need_dtype(fn, "guard", *guard, DType::kFloat32);
  need_rows(fn, "guard", *guard, world, guard_stride, "guard_stride", 1);
  same_device(fn, ref_name, ref, {{"guard", &*guard}});
}

// worker_scale_pack(_header): m (n elements), error (P = error.numel(), P % 8 == 0, P >= n) and the
// P/8 bytes of signs; the workspace scale_workspace_bytes(P) of m's device.
kernels::InputType check_worker_pack(const char* fn, const Buffer& mm, const Buffer& e, const Buffer& signs,
                                     const Buffer& ws) {
  const kernels::InputType t = need_input(fn, "m", mm);
  need_dtype(fn, "error", e, DType::kFloat32);
  need_dtype(fn, "signs", signs, DType::kUInt8);
  COMPCOMM_CHECK(e.count % 8 == 0 && e.count >= mm.count, fn, ": error has ", e.count,
                 " elements (P); P must be a multiple of 8 and >= m.numel() (", mm.count, ")");
  need_count(fn, "signs", signs, e.count / 8, "error.numel() / 8");
  need_scratch(fn, ws, mm, e.count, "error.numel()");
  same_device(fn, "m", mm, {{"error", &e}, {"signs", &signs}, {"workspace", &ws}});
  return t;
}

// The server side: signs (world rows of C/8 bytes, C = server_error.numel(), C % 8 == 0), scales
// (world fp32 at scale_stride) and server_error.
void check_server(const char* fn, const Buffer& signs, const Buffer& scales, int64_t stride, int world,
                  const Buffer& serr) {
  need_world(fn, world);
  need_dtype(fn, "signs", signs, DType::kUInt8);
  need_dtype(fn, "scales", scales, DType::kFloat32);
  need_dtype(fn, "server_error", serr, DType::kFloat32);
  COMPCOMM_CHECK(serr.count % 8 == 0, fn, ": server_error has ", serr.count,
                 " elements (the chunk C), not a multiple of 8");
  COMPCOMM_CHECK(serr.count / 8 <= signs.count / world, fn, ": signs has ", signs.count, " bytes, needs world (",
                 world, ") * server_error.numel() / 8 (", serr.count / 8, ")");
  need_rows(fn, "scales", scales, world, stride, "scale_stride", 1);
  same_device(fn, "signs", signs, {{"scales", &scales}, {"server_error", &serr}});
}

// The worker commit: m (n elements), error (P, P % (8 * world) == 0, P >= n), the worker scale and the
// world chunks' out_scales (at out_scale_stride) and out_signs (P / world / 8 bytes at out_sign_stride).
kernels::InputType check_worker_commit(const char* fn, const Buffer& mm, const Buffer& e, const Buffer& scale,
                                       const Buffer& out_scales, int64_t oss, const Buffer& out_signs,
                                       int64_t osb, int world) {
  need_world(fn, world);
  const kernels::InputType t = need_input(fn, "m", mm);
  need_dtype(fn, "error", e, DType::kFloat32);
  need_scale(fn, "scale", scale);
  need_dtype(fn, "out_scales", out_scales, DType::kFloat32);
  need_dtype(fn, "out_signs", out_signs, DType::kUInt8);
  COMPCOMM_CHECK(e.count % 8 == 0 && (e.count / 8) % world == 0 && e.count >= mm.count, fn, ": error has ",
                 e.count, " elements (P); P must be a multiple of 8 * world (world = ", world,
                 ") and >= m.numel() (", mm.count, ")");
  need_rows(fn, "out_scales", out_scales, world, oss, "out_scale_stride", 1);
  need_rows(fn, "out_signs", out_signs, world, osb, "out_sign_stride", e.count / world / 8);
  same_device(fn, "m", mm, {{"error", &e}, {"scale", &scale}, {"out_scales", &out_scales}, {"out_signs", &out_signs}});
  return t;
}

// Raise the compcomm.errors class `name` with the error's fields.
void raise(const char* name, const Error& e) {
  py::object cls = py::module_::import("compcomm.errors").attr(name);
  py::object exc = cls(e.what(), e.call(), e.backend(), e.code(), e.rank());
  PyErr_SetObject(cls.ptr(), exc.ptr());
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "compcomm's C++ core: communicators, the 1-bit compressed allreduce and its kernels.";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const TimeoutError& e) {
      raise("CommTimeoutError", e);
    } catch (const RankMismatchError& e) {
      raise("RankMismatchError", e);
    } catch (const NonFiniteError& e) {
      raise("NonFiniteError", e);
    } catch (const Unsupported& e) {
      raise("UnsupportedError", e);
    } catch (const BackendError& e) {
      raise("BackendError", e);
    } catch (const Error& e) {
      raise("CommError", e);
    }
  });

  py::enum_<DType>(m, "DType")
      .value("float32", DType::kFloat32)
      .value("float16", DType::kFloat16)
      .value("bfloat16", DType::kBFloat16)
      .value("uint8", DType::kUInt8)
      .value("int32", DType::kInt32)
      .value("int64", DType::kInt64)
      .value("float64", DType::kFloat64);

  py::enum_<ReduceOp>(m, "ReduceOp")
      .value("sum", ReduceOp::kSum)
      .value("max", ReduceOp::kMax)
      .value("min", ReduceOp::kMin);

  py::class_<CallOptions>(m, "CallOptions", "Timeout (seconds) and CUDA stream of one collective call.")
      .def_readonly("timeout_s", &CallOptions::timeout_s)
      .def_property_readonly("stream",
                             [](const CallOptions& o) { return reinterpret_cast<uintptr_t>(o.stream); });

  // dynamic_attr: compcomm._buffers.buffer_of stores the viewed tensor on the Python object
  // (`owner`), so a Buffer made from a temporary keeps it alive while the Buffer is in use.
  py::class_<Buffer>(m, "Buffer", py::buffer_protocol(), py::dynamic_attr(),
                     "A view of memory owned by someone else (host if device < 0, else a CUDA device).")
      .def(py::init([](uintptr_t data, int64_t count, DType dtype, int device) {
             COMPCOMM_CHECK(count >= 0, "Buffer: count must be >= 0, got ", count);
             return Buffer{reinterpret_cast<void*>(data), count, dtype, device};
           }),
           py::arg("data"), py::arg("count"), py::arg("dtype"), py::arg("device") = -1)
      .def_property_readonly("data", [](const Buffer& b) { return reinterpret_cast<uintptr_t>(b.data); })
      .def_readonly("count", &Buffer::count)
      .def_readonly("dtype", &Buffer::dtype)
      .def_readonly("device", &Buffer::device)
      .def_property_readonly("nbytes", &Buffer::bytes)
      .def_buffer([](const Buffer& b) -> py::buffer_info {
        COMPCOMM_CHECK(b.on_host(), "Buffer: the buffer protocol is only for host memory");
        const auto item = static_cast<py::ssize_t>(dtype_size(b.dtype));
        return py::buffer_info(b.data, item, buffer_format(b.dtype), 1, {static_cast<py::ssize_t>(b.count)},
                               {item}, false);
      })
      .def_property_readonly("__cuda_array_interface__", [](const Buffer& b) {
        COMPCOMM_CHECK(!b.on_host(), "Buffer: __cuda_array_interface__ is only for device memory");
        py::dict d;
        d["shape"] = py::make_tuple(b.count);
        d["typestr"] = typestr(b.dtype);
        d["data"] = py::make_tuple(reinterpret_cast<uintptr_t>(b.data), false);
        d["version"] = 3;
        d["stream"] = py::none();
        return d;
      });

  py::class_<Communicator, PyCommunicator, std::shared_ptr<Communicator>>(
      m, "Communicator",
      "The backend interface. Subclasses implement rank, size, backend_name and the do_* methods.")
      .def(py::init<>())
      .def("rank", &Communicator::rank)
      .def("size", &Communicator::size)
      .def("backend_name", &Communicator::backend_name)
      .def_property_readonly("bytes_sent", &Communicator::bytes_sent,
                             "Bytes this rank has sent through this communicator (nccl-tests conventions).")
      .def("reset_bytes_sent", &Communicator::reset_bytes_sent)
      .def_property_readonly("id", &Communicator::id,
                             "Unique over the process's lifetime (a later communicator never reuses it).")
      .def("alone", &Communicator::alone, py::arg("device"),
           "Whether this is a world of one rank whose collectives on buffers of `device` (-1: host) "
           "are plain copies: the 1-bit algorithms then run none (LocalCommunicator: always; a "
           "one-rank NCCL communicator: on its device; Python subclasses: never).")
      .def_property_readonly(
          "abort_flag",
          [](const Communicator& c) { return reinterpret_cast<uintptr_t>(c.abort_flag()); },
          "Address of the int an abort sets before cancelling enqueued work, which the commit of "
          "the 1-bit algorithms reads (0: none; the backend's calls complete or fail on the host). "
          "A Python subclass may provide it as do_abort_flag(self) -> int.")
      .def(
          "all_to_all",
          [](Communicator& c, const Buffer& s, const Buffer& r, double t, uintptr_t st) {
            call_keeping(c, {&s, &r}, [&] { c.all_to_all(s, r, options(t, st)); });
          },
          py::arg("send"), py::arg("recv"), py::arg("timeout_s") = 600.0, py::arg("stream") = 0)
      .def(
          "all_gather",
          [](Communicator& c, const Buffer& s, const Buffer& r, double t, uintptr_t st) {
            call_keeping(c, {&s, &r}, [&] { c.all_gather(s, r, options(t, st)); });
          },
          py::arg("send"), py::arg("recv"), py::arg("timeout_s") = 600.0, py::arg("stream") = 0)
      .def(
          "reduce_scatter",
          [](Communicator& c, const Buffer& s, const Buffer& r, ReduceOp op, double t, uintptr_t st) {
            call_keeping(c, {&s, &r}, [&] { c.reduce_scatter(s, r, op, options(t, st)); });
          },
          py::arg("send"), py::arg("recv"), py::arg("op") = ReduceOp::kSum, py::arg("timeout_s") = 600.0,
          py::arg("stream") = 0)
      .def(
          "all_reduce",
          [](Communicator& c, const Buffer& b, ReduceOp op, double t, uintptr_t st) {
            call_keeping(c, {&b}, [&] { c.all_reduce(b, op, options(t, st)); });
          },
          py::arg("buf"), py::arg("op") = ReduceOp::kSum, py::arg("timeout_s") = 600.0, py::arg("stream") = 0)
      .def(
          "broadcast",
          [](Communicator& c, const Buffer& b, int root, double t, uintptr_t st) {
            call_keeping(c, {&b}, [&] { c.broadcast(b, root, options(t, st)); });
          },
          py::arg("buf"), py::arg("root") = 0, py::arg("timeout_s") = 600.0, py::arg("stream") = 0)
      .def(
          "barrier", [](Communicator& c, double t) { c.barrier(options(t, 0)); }, py::arg("timeout_s") = 600.0,
          py::call_guard<py::gil_scoped_release>());

  py::class_<LocalCommunicator, Communicator, std::shared_ptr<LocalCommunicator>>(
      m, "LocalCommunicator", "A world of one rank; collectives are copies. Needs no network.")
      .def(py::init<>());

  m.def(
      "compressed_allreduce",
      [](Communicator& comm, const Buffer& tensor, const Buffer& worker_error, const Buffer& server_error,
         const Buffer& workspace, double timeout_s, uintptr_t stream, bool check) {
        CallOptions opts = options(timeout_s, stream);
        opts.check = check;
        call_keeping(comm, {&tensor, &worker_error, &server_error, &workspace},
                     [&] { compressed_allreduce(comm, tensor, worker_error, server_error, workspace, opts); });
      },
      py::arg("comm"), py::arg("tensor"), py::arg("worker_error"), py::arg("server_error"),
      py::arg("workspace"), py::arg("timeout_s") = 600.0, py::arg("stream") = 0, py::arg("check") = true,
      "The 1-bit compressed allreduce on raw buffers (see compcomm.compressed_allreduce).");

  m.def(
      "compressed_allreduce_layout",
      [](int64_t padded, int world, bool cuda) {
        const CompressedAllreduceLayout l = compressed_allreduce_layout(padded, world, cuda);
        py::dict d;
        d["header_send"] = l.header_send;
        d["header_recv"] = l.header_recv;
        d["signs_send"] = l.signs_send;
        d["signs_recv"] = l.signs_recv;
        d["record_send"] = l.record_send;
        d["record_recv"] = l.record_recv;
        d["scratch"] = l.scratch;
        d["record_bytes"] = l.record_bytes;
        d["record_scale_bytes"] = l.record_scale_bytes;
        d["total"] = l.total;
        return d;
      },
      py::arg("padded"), py::arg("world"), py::arg("cuda") = false,
      "Byte offsets of the workspace regions; 'total' is the workspace size to allocate.");

  m.def(
      "compressed_allreduce_wire_bytes",
      [](int64_t padded, int world) {
        return compressed_allreduce_wire_bytes(padded, world);
      },
      py::arg("padded"), py::arg("world"), "Bytes one rank sends in one compressed_allreduce call.");

#ifdef COMPCOMM_WITH_MPI
  bind_mpi(m);
#endif
#ifdef COMPCOMM_WITH_NCCL
  bind_nccl(m);
#endif
  bind_zero(m);
  bind_optim_cuda(m);
  bind_optim(m);

  m.def("build_info", &build_info_dict, "What this build contains (CUDA, NCCL, MPI) and their versions.");

  // Kernels on Buffers: host buffers run the CPU twin, device buffers the CUDA kernel. For tests/bench.
  py::module_ k = m.def_submodule("kernels", "The compression kernels, dispatched on the buffers' device.");
  k.def(
      "scale_workspace_bytes",
      [](int64_t count, bool cuda) {
        return cuda ? kernels::cuda::scale_workspace_bytes(count) : kernels::cpu::scale_workspace_bytes(count);
      },
      py::arg("count"), py::arg("cuda") = false);
  k.def(
      "worker_scale_pack",
      [](const Buffer& mm, const Buffer& e, const Buffer& scale, const Buffer& signs, const Buffer& ws,
         uintptr_t stream) {
        const char* fn = "worker_scale_pack";
        const kernels::InputType t = check_worker_pack(fn, mm, e, signs, ws);
        need_scale(fn, "scale", scale);
        same_device(fn, "m", mm, {{"scale", &scale}});
        auto f = mm.on_host() ? kernels::cpu::worker_scale_pack : kernels::cuda::worker_scale_pack;
        check(f(mm.data, t, mm.count, ptr<const float>(e), e.count, ptr<float>(scale),
                ptr<uint8_t>(signs), ws.data, reinterpret_cast<void*>(stream)),
              "worker_scale_pack");
      },
      py::arg("m"), py::arg("error"), py::arg("scale"), py::arg("signs"), py::arg("workspace"),
      py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>());
  k.def(
      "server_scale_pack",
      [](const Buffer& signs, const Buffer& scales, int64_t stride, int world, const Buffer& serr,
         const Buffer& scale, const Buffer& packed, const Buffer& ws, uintptr_t stream) {
        const char* fn = "server_scale_pack";
        check_server(fn, signs, scales, stride, world, serr);
        need_scale(fn, "scale", scale);
        need_dtype(fn, "packed", packed, DType::kUInt8);
        need_count(fn, "packed", packed, serr.count / 8, "server_error.numel() / 8");
        need_scratch(fn, ws, signs, serr.count, "server_error.numel()");
        same_device(fn, "signs", signs, {{"scale", &scale}, {"packed", &packed}, {"workspace", &ws}});
        auto f = signs.on_host() ? kernels::cpu::server_scale_pack : kernels::cuda::server_scale_pack;
        check(f(ptr<const uint8_t>(signs), ptr<const float>(scales), stride, world, ptr<const float>(serr),
                serr.count, ptr<float>(scale), ptr<uint8_t>(packed), ws.data, reinterpret_cast<void*>(stream)),
              "server_scale_pack");
      },
      py::arg("signs"), py::arg("scales"), py::arg("scale_stride"), py::arg("world"), py::arg("server_error"),
      py::arg("scale"), py::arg("packed"), py::arg("workspace"), py::arg("stream") = 0,
      py::call_guard<py::gil_scoped_release>());
  k.def(
      "server_update",
      [](const Buffer& signs, const Buffer& scales, int64_t stride, int world, const Buffer& serr,
         const Buffer& scale, uintptr_t stream, std::optional<Buffer> guard, int64_t guard_stride) {
        const char* fn = "server_update";
        check_server(fn, signs, scales, stride, world, serr);
        need_scale(fn, "scale", scale);
        same_device(fn, "signs", signs, {{"scale", &scale}});
        check_guard(fn, guard, guard_stride, world, "signs", signs);
        auto f = signs.on_host() ? kernels::cpu::server_update : kernels::cuda::server_update;
        check(f(ptr<const uint8_t>(signs), ptr<const float>(scales), stride, world, ptr<float>(serr),
                serr.count, ptr<const float>(scale), reinterpret_cast<void*>(stream),
                guard ? ptr<const float>(*guard) : nullptr, guard_stride),
              "server_update");
      },
      py::arg("signs"), py::arg("scales"), py::arg("scale_stride"), py::arg("world"), py::arg("server_error"),
      py::arg("scale"), py::arg("stream") = 0, py::arg("guard") = std::optional<Buffer>(),
      py::arg("guard_stride") = 1, py::call_guard<py::gil_scoped_release>());
  k.def(
      "worker_update_decompress",
      [](const Buffer& mm, const Buffer& e, const Buffer& scale, const Buffer& out_scales,
         int64_t out_scale_stride, const Buffer& out_signs, int64_t out_sign_stride, int world,
         uintptr_t stream, std::optional<Buffer> guard, int64_t guard_stride) {
        const char* fn = "worker_update_decompress";
        const kernels::InputType t =
            check_worker_commit(fn, mm, e, scale, out_scales, out_scale_stride, out_signs, out_sign_stride, world);
        check_guard(fn, guard, guard_stride, world, "m", mm);
        auto f = mm.on_host() ? kernels::cpu::worker_update_decompress
                              : kernels::cuda::worker_update_decompress;
        check(f(mm.data, t, mm.count, ptr<float>(e), e.count, ptr<const float>(scale),
                ptr<const float>(out_scales), out_scale_stride, ptr<const uint8_t>(out_signs),
                out_sign_stride, world, reinterpret_cast<void*>(stream),
                guard ? ptr<const float>(*guard) : nullptr, guard_stride),
              "worker_update_decompress");
      },
      py::arg("m"), py::arg("error"), py::arg("scale"), py::arg("out_scales"), py::arg("out_scale_stride"),
      py::arg("out_signs"), py::arg("out_sign_stride"), py::arg("world"), py::arg("stream") = 0,
      py::arg("guard") = std::optional<Buffer>(), py::arg("guard_stride") = 1,
      py::call_guard<py::gil_scoped_release>());
  k.def(
      "worker_scale_pack_header",
      [](const Buffer& mm, const Buffer& e, const Buffer& header, const Buffer& signs, const Buffer& ws,
         uint32_t magic, uintptr_t stream, std::optional<Buffer> notice, uint64_t seq) {
        const kernels::InputType t = check_worker_pack("worker_scale_pack_header", mm, e, signs, ws);
        same_device("worker_scale_pack_header", "m", mm, {{"header", &header}});
        COMPCOMM_CHECK(header.bytes() >= static_cast<int64_t>(sizeof(kernels::ExchangeHeader)),
                       "worker_scale_pack_header: header needs 32 bytes");
        COMPCOMM_CHECK(!notice || notice->bytes() >= static_cast<int64_t>(sizeof(kernels::HeaderNotice)),
                       "worker_scale_pack_header: notice needs 64 bytes");
        // the kernel writes it: on m's device (a host notice for a GPU kernel would be an illegal
        // address that breaks the CUDA context), its 8-byte tag aligned
        COMPCOMM_CHECK(!notice || notice->device == mm.device,
                       "worker_scale_pack_header: notice must be on m's device");
        COMPCOMM_CHECK(!notice || reinterpret_cast<uintptr_t>(notice->data) % 8 == 0,
                       "worker_scale_pack_header: notice must be 8-byte aligned");
        auto f = mm.on_host() ? kernels::cpu::worker_scale_pack_header : kernels::cuda::worker_scale_pack_header;
        check(f(mm.data, t, mm.count, ptr<const float>(e), e.count,
                static_cast<kernels::ExchangeHeader*>(header.data), static_cast<int32_t>(mm.dtype), magic,
                ptr<uint8_t>(signs), ws.data, reinterpret_cast<void*>(stream),
                notice ? static_cast<kernels::HeaderNotice*>(notice->data) : nullptr, seq),
              "worker_scale_pack_header");
      },
      py::arg("m"), py::arg("error"), py::arg("header"), py::arg("signs"), py::arg("workspace"),
      py::arg("magic") = 0, py::arg("stream") = 0, py::arg("notice") = std::optional<Buffer>(),
      py::arg("seq") = 0, py::call_guard<py::gil_scoped_release>(),
      "worker_scale_pack and the 32-byte exchange header (scale, flags, numel, padded, dtype code, "
      "magic) in one launch; with `notice` (64 bytes the kernel can write) the header is also posted "
      "there, then the 8-byte tag `seq` at byte 32.");
  k.def(
      "read_notice",
      [](const Buffer& notice, uint64_t seq) {
        COMPCOMM_CHECK(notice.on_host() && notice.bytes() >= static_cast<int64_t>(sizeof(kernels::HeaderNotice)),
                       "read_notice: notice must be 64 bytes of host memory");
        COMPCOMM_CHECK(reinterpret_cast<uintptr_t>(notice.data) % 8 == 0, "read_notice: notice must be 8-byte aligned");
        kernels::ExchangeHeader h{};
        const auto state = kernels::read_notice(static_cast<const kernels::HeaderNotice*>(notice.data), seq, &h);
        return state == kernels::NoticeState::kReady ? "ready"
               : state == kernels::NoticeState::kTorn ? "torn"
                                                       : "pending";
      },
      py::arg("notice"), py::arg("seq"),
      "How a call waiting on tag `seq` reads a (host copy of a) 64-byte notice: 'pending' (not posted), "
      "'ready' (its header, whole) or 'torn' (another writer overwrote it: not to be trusted).");
  k.def("notice_address", &notice_address, py::arg("cuda"),
        "Tests: the host address of this thread's notice for host (cuda=False) or device calls; 0 where "
        "mapped memory cannot be had. It changes after a call abandoned its notice.");
  k.def(
      "commit",
      [](const Buffer& signs, const Buffer& scales, int64_t stride, const Buffer& serr, const Buffer& server_scale,
         const Buffer& mm, const Buffer& e, const Buffer& scale, const Buffer& out_scales, int64_t out_scale_stride,
         const Buffer& out_signs, int64_t out_sign_stride, int world, uintptr_t stream, std::optional<Buffer> guard,
         int64_t guard_stride) {
        const char* fn = "commit";
        const kernels::InputType t =
            check_worker_commit(fn, mm, e, scale, out_scales, out_scale_stride, out_signs, out_sign_stride, world);
        COMPCOMM_CHECK(serr.count == e.count / world, fn, ": server_error has ", serr.count,
                       " elements, needs error.numel() / world (", e.count / world, ")");
        same_device(fn, "m", mm, {{"signs", &signs}, {"server_scale", &server_scale}});  // check_server: the rest
        check_server(fn, signs, scales, stride, world, serr);
        need_scale(fn, "server_scale", server_scale);
        check_guard(fn, guard, guard_stride, world, "m", mm);
        auto f = mm.on_host() ? kernels::cpu::commit : kernels::cuda::commit;
        check(f(ptr<const uint8_t>(signs), ptr<const float>(scales), stride, ptr<float>(serr),
                ptr<const float>(server_scale), mm.data, t, mm.count, ptr<float>(e), e.count,
                ptr<const float>(scale), ptr<const float>(out_scales), out_scale_stride,
                ptr<const uint8_t>(out_signs), out_sign_stride, world, reinterpret_cast<void*>(stream),
                guard ? ptr<const float>(*guard) : nullptr, guard_stride),
              "commit");
      },
      py::arg("signs"), py::arg("scales"), py::arg("scale_stride"), py::arg("server_error"),
      py::arg("server_scale"), py::arg("m"), py::arg("error"), py::arg("scale"), py::arg("out_scales"),
      py::arg("out_scale_stride"), py::arg("out_signs"), py::arg("out_sign_stride"), py::arg("world"),
      py::arg("stream") = 0, py::arg("guard") = std::optional<Buffer>(), py::arg("guard_stride") = 1,
      py::call_guard<py::gil_scoped_release>(),
      "server_update and worker_update_decompress in one launch, under one guard.");
  k.def(
      "decompress",
      [](const Buffer& scale, const Buffer& packed, const Buffer& out, uintptr_t stream) {
        const char* fn = "decompress";
        need_scale(fn, "scale", scale);
        need_dtype(fn, "packed", packed, DType::kUInt8);
        need_dtype(fn, "out", out, DType::kFloat32);
        need_count(fn, "packed", packed, out.count / 8 + (out.count % 8 != 0), "ceil(out.numel() / 8)");
        same_device(fn, "out", out, {{"scale", &scale}, {"packed", &packed}});
        auto f = out.on_host() ? kernels::cpu::decompress : kernels::cuda::decompress;
        check(f(ptr<const float>(scale), ptr<const uint8_t>(packed), out.count, ptr<float>(out),
                reinterpret_cast<void*>(stream), nullptr, 0, 0),
              "decompress");
      },
      py::arg("scale"), py::arg("packed"), py::arg("out"), py::arg("stream") = 0,
      py::call_guard<py::gil_scoped_release>());
  k.def(
      "commit_gate",
      [](const Buffer& flag, const Buffer& scales, int64_t stride, int world, uintptr_t stream) {
        COMPCOMM_CHECK(flag.dtype == DType::kInt32 && flag.count >= 1, "commit_gate: flag must be int32");
        COMPCOMM_CHECK(scales.dtype == DType::kFloat32 && world >= 0 && stride >= 1 &&
                           (world == 0 || (world - 1) * stride < scales.count),
                       "commit_gate: scales must be float32 with (world-1)*stride < numel");
        // The kernel dereferences flag where it runs scales' kernel: a host flag in a CUDA kernel
        // is an illegal address, a device flag on the host a segfault.
        COMPCOMM_CHECK(flag.device == scales.device, "commit_gate: flag must be on the same device as scales (",
                       flag.on_host() ? std::string("host") : "cuda:" + std::to_string(flag.device), " vs ",
                       scales.on_host() ? std::string("host") : "cuda:" + std::to_string(scales.device), ")");
        auto f = scales.on_host() ? kernels::cpu::commit_gate : kernels::cuda::commit_gate;
        check(f(ptr<const int>(flag), ptr<float>(scales), stride, world, reinterpret_cast<void*>(stream)),
              "commit_gate");
      },
      py::arg("flag"), py::arg("scales"), py::arg("stride"), py::arg("world"), py::arg("stream") = 0,
      py::call_guard<py::gil_scoped_release>());
  k.def(
      "batch_copy",
      [](const std::vector<Buffer>& dsts, const std::vector<Buffer>& srcs, uintptr_t stream) {
        COMPCOMM_CHECK(dsts.size() == srcs.size(), "batch_copy: dsts and srcs must have the same length (",
                       dsts.size(), ", ", srcs.size(), ")");
        std::vector<kernels::CopyJob> jobs;
        for (size_t i = 0; i < dsts.size(); ++i) {
          COMPCOMM_CHECK(dsts[i].device == dsts[0].device && srcs[i].device == dsts[0].device, "batch_copy: dsts[",
                         i, "] and srcs[", i, "] must be on the device of dsts[0]");
          COMPCOMM_CHECK(dsts[i].bytes() >= srcs[i].bytes(), "batch_copy: dsts[", i, "] has ", dsts[i].bytes(),
                         " bytes, fewer than srcs[", i, "] (", srcs[i].bytes(), ")");
          jobs.push_back(kernels::CopyJob{srcs[i].data, dsts[i].data, srcs[i].bytes()});
        }
        if (jobs.empty()) return;
        const kernels::ScopedDevice on(dsts[0].device);  // the stream and the launch of that device
        auto f = dsts[0].on_host() ? kernels::cpu::batch_copy : kernels::cuda::batch_copy;
        check(f(jobs.data(), static_cast<int64_t>(jobs.size()), reinterpret_cast<void*>(stream)), "batch_copy");
      },
      py::arg("dsts"), py::arg("srcs"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
      "Copies srcs[i] (all its bytes) to the start of dsts[i] for every i: one kernel launch on a GPU "
      "(the batched copies of compressed_allreduce_exchange_many), a memcpy loop on the host.");

  // The packed 1-bit momentum (cpp/kernels/packed_momentum.h): host buffers only (GPU tensors take
  // compcomm.zero.packed_momentum's torch-op path). Sizes are checked here, naming the argument.
  k.def(
      "unpack_momentum",
      [](const Buffer& signs, const Buffer& scales, int64_t chunk, int64_t numel, int64_t begin,
         const Buffer& out, float mul) {
        for (const Buffer* b : {&signs, &scales, &out})
          COMPCOMM_CHECK(b->on_host(), "unpack_momentum: signs, scales and out must be host buffers");
        COMPCOMM_CHECK(signs.dtype == DType::kUInt8, "unpack_momentum: signs must be uint8, got ",
                       dtype_name(signs.dtype));
        COMPCOMM_CHECK(scales.dtype == DType::kFloat32 && out.dtype == DType::kFloat32,
                       "unpack_momentum: scales and out must be float32");
        COMPCOMM_CHECK(begin >= 0 && numel >= 0, "unpack_momentum: begin and numel must be >= 0");
        COMPCOMM_CHECK(out.count == 0 || chunk >= 1, "unpack_momentum: chunk must be >= 1, got ", chunk);
        const int64_t end = begin + out.count;
        const int64_t live = std::min(end, numel);
        COMPCOMM_CHECK(live <= begin || signs.count * 8 >= live, "unpack_momentum: signs has ", signs.count,
                       " bytes; elements up to ", live, " need ", (live + 7) / 8);
        COMPCOMM_CHECK(live <= begin || scales.count * chunk >= live, "unpack_momentum: scales has ",
                       scales.count, " chunks of ", chunk, "; elements up to ", live, " need more");
        check(kernels::cpu::unpack_momentum(ptr<const uint8_t>(signs), ptr<const float>(scales), chunk, numel,
                                            begin, out.count, mul, ptr<float>(out)),
              "unpack_momentum");
      },
      py::arg("signs"), py::arg("scales"), py::arg("chunk"), py::arg("numel"), py::arg("begin"), py::arg("out"),
      py::arg("mul") = 1.0f, py::call_guard<py::gil_scoped_release>());
  k.def(
      "pack_momentum",
      [](const Buffer& x, int64_t chunk, const Buffer& signs, const Buffer& scales) {
        for (const Buffer* b : {&x, &signs, &scales})
          COMPCOMM_CHECK(b->on_host(), "pack_momentum: x, signs and scales must be host buffers");
        COMPCOMM_CHECK(signs.dtype == DType::kUInt8 && scales.dtype == DType::kFloat32,
                       "pack_momentum: signs must be uint8 and scales float32");
        COMPCOMM_CHECK(x.count % 8 == 0, "pack_momentum: x has ", x.count, " elements, not a multiple of 8");
        COMPCOMM_CHECK(x.count == 0 || (chunk >= 1 && x.count % chunk == 0), "pack_momentum: chunk ", chunk,
                       " does not divide x's ", x.count, " elements");
        COMPCOMM_CHECK(signs.count * 8 == x.count, "pack_momentum: signs has ", signs.count, " bytes, x needs ",
                       x.count / 8);
        COMPCOMM_CHECK(x.count == 0 || scales.count == x.count / chunk, "pack_momentum: scales has ",
                       scales.count, " elements, x has ", x.count == 0 ? 0 : x.count / chunk, " chunks");
        check(kernels::cpu::pack_momentum(x.data, itype(x), x.count, chunk, ptr<uint8_t>(signs),
                                          ptr<float>(scales)),
              "pack_momentum");
      },
      py::arg("x"), py::arg("chunk"), py::arg("signs"), py::arg("scales"),
      py::call_guard<py::gil_scoped_release>());
  k.def(
      "sum_squares",
      [](const Buffer& x) {
        COMPCOMM_CHECK(x.on_host(), "sum_squares: x must be a host buffer");
        double out = 0.0;
        check(kernels::cpu::sum_squares(x.data, itype(x), x.count, &out), "sum_squares");
        return out;
      },
      py::arg("x"), py::call_guard<py::gil_scoped_release>(),
      "sum of x_k^2 in fp64, one pass over fp32/fp16/bf16 host data (8 interleaved partial sums).");
}
