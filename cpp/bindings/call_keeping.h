// Communicator calls from Python that may leave transfers running after they fail.
#pragma once

#include <pybind11/pybind11.h>

#include <initializer_list>

#include "../comm.h"

namespace compcomm {

// Runs `call` without the GIL. If it fails and leaves transfers running on its buffers
// (Communicator::requests_left: MPI after a timeout, which cannot cancel them), the Python objects of
// the communicator and of `bufs` -- a Buffer holds its tensor (`owner`), a communicator its cached
// workspaces -- are kept for the rest of the process, so that memory is never freed and reused while
// those transfers may still read or write it.
template <class F>
void call_keeping(const Communicator& comm, std::initializer_list<const Buffer*> bufs, F&& call) {
  namespace py = pybind11;
  try {
    py::gil_scoped_release release;
    call();
  } catch (...) {
    if (comm.requests_left()) {
      static py::list* kept = new py::list();  // never destroyed, not even at interpreter exit
      // the existing Python objects of these C++ objects (a reference cast finds them)
      kept->append(py::cast(&comm, py::return_value_policy::reference));
      for (const Buffer* b : bufs) kept->append(py::cast(b, py::return_value_policy::reference));
    }
    throw;
  }
}

}  // namespace compcomm
