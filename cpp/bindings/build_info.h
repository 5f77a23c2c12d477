// compcomm._C.build_info(): what this build contains. Each optional part adds its entries here.
#pragma once

#include <pybind11/pybind11.h>

#include "../kernels/kernels.h"

#ifndef COMPCOMM_VERSION
#define COMPCOMM_VERSION "0.0.0"
#endif

inline pybind11::dict build_info_dict() {
  pybind11::dict d;
  d["version"] = COMPCOMM_VERSION;
  d["cuda"] = compcomm::kernels::cuda::built();
#ifdef COMPCOMM_CUDA_VERSION
  d["cuda_version"] = COMPCOMM_CUDA_VERSION;
#else
  d["cuda_version"] = pybind11::none();
#endif
#ifdef COMPCOMM_CUDA_ARCHITECTURES
  d["cuda_architectures"] = COMPCOMM_CUDA_ARCHITECTURES;
#endif
#ifdef COMPCOMM_WITH_NCCL
  d["nccl"] = true;
  d["nccl_version"] = COMPCOMM_NCCL_VERSION;
#else
  d["nccl"] = false;
  d["nccl_version"] = pybind11::none();
#endif
#ifdef COMPCOMM_WITH_MPI
  d["mpi"] = true;
  d["mpi_version"] = COMPCOMM_MPI_VERSION;
#else
  d["mpi"] = false;
  d["mpi_version"] = pybind11::none();
#endif
  d["compiler"] = __VERSION__;
  return d;
}
