// compcomm._C.NcclCommunicator and the compcomm._C.nccl helpers (library loading, unique ids).
// Compiled only when the build found CUDA and NCCL's header (COMPCOMM_WITH_NCCL).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "../nccl/nccl_comm.h"

namespace py = pybind11;

void bind_nccl(py::module_& m) {
  using compcomm::Communicator;
  using compcomm::nccl::NcclCommunicator;
  py::module_ n =
      m.def_submodule("nccl", "The run-time NCCL library: loading, version, unique ids.");
  n.def(
      "load", &compcomm::nccl::load, py::arg("candidates") = std::vector<std::string>{},
      "Load libnccl.so.2 (once): $COMPCOMM_NCCL_LIBRARY, the copy already in the process, each of "
      "candidates, then the system's. Returns the path in use; raises UnsupportedError if none "
      "loads.");
  n.def("loaded", &compcomm::nccl::loaded, "True once load() succeeded.");
  n.def("runtime_version", &compcomm::nccl::runtime_version,
        "Version code of the loaded NCCL library (e.g. 22809 for 2.28.9).");
  n.def(
      "unique_id", [] { return py::bytes(compcomm::nccl::unique_id()); },
      "A new ncclUniqueId as 128 bytes: create it on one rank and give it to all.");
  n.attr("UNIQUE_ID_BYTES") = compcomm::nccl::kUniqueIdBytes;

  py::class_<NcclCommunicator, Communicator, std::shared_ptr<NcclCommunicator>>(
      m, "NcclCommunicator",
      "A Communicator over an NCCL communicator, for CUDA buffers on one device. Collectives run "
      "on the "
      "given stream without host synchronization (capturable in CUDA graphs); a watchdog aborts "
      "the "
      "communicator when a collective outlives its timeout, and later calls then raise.")
      .def(py::init([](py::bytes unique_id, int rank, int size, int device, double timeout_s,
                       bool blocking, bool watchdog) {
             std::string id = unique_id;
             py::gil_scoped_release release;
             return std::make_shared<NcclCommunicator>(id, rank, size, device, timeout_s, blocking,
                                                       watchdog);
           }),
           py::arg("unique_id"), py::arg("rank"), py::arg("size"), py::arg("device"),
           py::arg("timeout_s") = 600.0, py::arg("blocking") = true, py::arg("watchdog") = true,
           "Join the communicator `unique_id` (nccl.unique_id() from one rank) as rank of size, on "
           "CUDA device "
           "`device`; every rank must call this (waits at most timeout_s).")
      .def_property_readonly("device", &NcclCommunicator::device)
      .def_property_readonly("blocking", &NcclCommunicator::blocking)
      .def_property_readonly("closed", &NcclCommunicator::closed,
                             "True once destroyed or aborted (by abort() or the timeout watchdog).")
      .def_property_readonly("closed_reason", &NcclCommunicator::closed_reason)
      .def("destroy", &NcclCommunicator::destroy, py::arg("timeout_s") = 30.0,
           py::call_guard<py::gil_scoped_release>(),
           "Finalize and free the NCCL communicator (aborts if pending work does not finish in "
           "timeout_s).")
      .def("abort", &NcclCommunicator::abort, py::arg("reason") = "aborted by the user",
           py::call_guard<py::gil_scoped_release>(), "Abort now; pending device work is cancelled.")
      .def("synchronize", &NcclCommunicator::synchronize, py::arg("timeout_s") = 600.0,
           py::call_guard<py::gil_scoped_release>(),
           "Wait (at most timeout_s) for the device work of this communicator's collectives (world "
           "size > 1; "
           "aborts and raises CommTimeoutError on timeout).")
      .def(
          "barrier_on",
          [](Communicator& c, uintptr_t stream, double t) {
            COMPCOMM_CHECK(t > 0, "timeout must be positive, got ", t);
            c.barrier(compcomm::CallOptions{t, reinterpret_cast<void*>(stream)});
          },
          py::arg("stream"), py::arg("timeout_s") = 600.0, py::call_guard<py::gil_scoped_release>(),
          "barrier() on a given CUDA stream (barrier() uses the legacy default stream).");
}
