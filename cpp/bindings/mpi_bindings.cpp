// Bindings of the MPI communicator (compcomm._C.MpiCommunicator and MPI queries). Compiled into _C
// always; empty unless the build found MPI (COMPCOMM_WITH_MPI). module.cpp calls bind_mpi().
#ifdef COMPCOMM_WITH_MPI

#include <pybind11/pybind11.h>

#include <cstdint>
#include <type_traits>

#include <utility>

#include "../mpi/backoff.h"
#include "../mpi/mpi_comm.h"

namespace py = pybind11;
using compcomm::CudaAware;
using compcomm::MpiCommunicator;

namespace {

// MPI_Comm is a pointer in Open MPI and an int in MPICH-derived libraries; mpi4py gives it as an int.
template <class C>
C comm_from_int(uintptr_t v) {
  if constexpr (std::is_pointer_v<C>) {
    return reinterpret_cast<C>(v);
  } else {
    return static_cast<C>(v);
  }
}
template <class C>
uintptr_t int_from_comm(C c) {
  if constexpr (std::is_pointer_v<C>) {
    return reinterpret_cast<uintptr_t>(c);
  } else {
    return static_cast<uintptr_t>(c);
  }
}

// An MPI_Comm from mpi4py's integer handle (MPI._handleof(comm), comm.handle) or None (world).
MPI_Comm comm_of(const py::object& handle) {
  if (handle.is_none()) return MPI_COMM_WORLD;
  if (!py::isinstance<py::int_>(handle) || py::isinstance<py::bool_>(handle))
    throw py::type_error("MpiCommunicator: comm must be an integer MPI_Comm handle (mpi4py: "
                         "MPI._handleof(comm)) or None for MPI_COMM_WORLD, got " +
                         std::string(Py_TYPE(handle.ptr())->tp_name));
  return comm_from_int<MPI_Comm>(handle.cast<uintptr_t>());
}

uintptr_t handle_of(MPI_Comm c) { return int_from_comm<MPI_Comm>(c); }

CudaAware mode_of(const py::object& cuda_aware) {
  if (cuda_aware.is_none()) return CudaAware::kDetect;
  if (!py::isinstance<py::bool_>(cuda_aware))
    throw py::type_error("MpiCommunicator: cuda_aware must be True, False or None (detect)");
  return cuda_aware.cast<bool>() ? CudaAware::kOn : CudaAware::kOff;
}

}  // namespace

void bind_mpi(py::module_& m) {
  py::class_<MpiCommunicator, compcomm::Communicator, std::shared_ptr<MpiCommunicator>>(
      m, "MpiCommunicator",
      "A Communicator over a duplicate of an MPI communicator (non-blocking collectives polled with "
      "the call's timeout). CUDA buffers go to MPI directly when cuda_aware, else through pinned "
      "host staging buffers.")
      .def(py::init([](const py::object& comm, const py::object& cuda_aware, double timeout_s) {
             const MPI_Comm c = comm_of(comm);
             const CudaAware mode = mode_of(cuda_aware);
             py::gil_scoped_release release;  // MPI_Comm_idup waits for the other ranks
             return std::make_shared<MpiCommunicator>(c, mode, timeout_s);
           }),
           py::arg("comm") = py::none(), py::arg("cuda_aware") = py::none(), py::arg("timeout_s") = 600.0,
           "comm: MPI_Comm handle as an int (mpi4py: MPI._handleof(comm)) or None for MPI_COMM_WORLD; "
           "cuda_aware: None detects, True requires a CUDA-aware MPI (else UnsupportedError), False "
           "stages device buffers through host memory; timeout_s bounds the MPI_Comm_idup.")
      .def_property_readonly("cuda_aware", &MpiCommunicator::cuda_aware,
                             "True when device buffers go to MPI directly, False when host-staged.")
      .def_property_readonly(
          "handle", [](const MpiCommunicator& c) { return handle_of(c.handle()); },
          "The duplicated MPI_Comm compcomm uses, as an integer handle.")
      .def_property_readonly("staging_bytes", &MpiCommunicator::staging_bytes,
                             "Pinned host staging memory held (bytes).")
      .def_property("pipeline_chunk_bytes", &MpiCommunicator::pipeline_chunk_bytes,
                    &MpiCommunicator::set_pipeline_chunk_bytes,
                    "Piece size (bytes) of all_to_all/all_gather messages (not CUDA-aware) and of the "
                    "host-staged all_reduce/broadcast chunks (0: one piece).");

  m.def(
      "_mpi_backoff_schedule",
      [](const py::list& polls, int64_t bytes, bool oversubscribed) {
        // Replays the wait loops' policy on a made-up clock: for each poll (time, progressed), what the
        // loop does next: "progress", "spin", "yield" or the sleep in microseconds.
        const auto policy = oversubscribed ? compcomm::BackoffPolicy::oversubscribed() : compcomm::BackoffPolicy{};
        compcomm::Backoff b(policy, 0.0, bytes);
        py::list out;
        for (const py::handle& poll : polls) {
          const auto [t, progressed] = poll.cast<std::pair<double, bool>>();
          if (progressed) {
            b.progressed(t);
            out.append("progress");
            continue;
          }
          int us = 0;
          switch (b.idle(t, &us)) {
            case compcomm::Backoff::Action::kSpin: out.append("spin"); break;
            case compcomm::Backoff::Action::kYield: out.append("yield"); break;
            case compcomm::Backoff::Action::kSleep: out.append(us); break;
          }
        }
        return out;
      },
      py::arg("polls"), py::arg("bytes") = 0, py::arg("oversubscribed") = false,
      "Test hook: the MPI wait loops' back-off (cpp/mpi/backoff.h; its oversubscribed-node policy if asked) "
      "replayed on (time_s, progressed) polls starting at time 0 with `bytes` in flight; returns "
      "'progress', 'spin', 'yield' or a sleep in us per poll.");
  m.def("mpi_reports_cuda_support", &compcomm::mpi_reports_cuda_support,
        "Whether the MPI library reports CUDA support at run time (MPIX_Query_cuda_support); "
        "COMPCOMM_MPI_CUDA_AWARE=1/0 overrides. Initializes MPI if needed.");
  m.def("mpi_library_version", &compcomm::mpi_library_version,
        "The MPI library's version line (MPI_Get_library_version).");
  m.def("mpi_cuda_built", &compcomm::mpi_cuda_built,
        "Whether this build can pass CUDA buffers through MPI (compiled with the CUDA runtime).");
}

#endif  // COMPCOMM_WITH_MPI
