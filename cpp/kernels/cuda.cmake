# Decides whether the CUDA kernels are built. Included from the top-level CMakeLists.txt because
# enable_language() must run in the directory that owns the targets compiling CUDA sources.
# Sets COMPCOMM_CUDA (ON/OFF) for cpp/kernels/CMakeLists.txt.
#
#   -DCOMPCOMM_WITH_CUDA=OFF                     never build the kernels (the stub is used)
#   -DCOMPCOMM_CUDA_ARCHITECTURES="80-real;90"   targets (default: sm_90 machine code + PTX; sm_70 or
#                                                 newer: the batched kernels take __grid_constant__ packs)
#   CUDACXX=/path/to/nvcc or -DCMAKE_CUDA_COMPILER=...   which nvcc (default: PATH, then CUDA_HOME,
#                                                        CUDA_PATH, /usr/local/cuda)
option(COMPCOMM_WITH_CUDA "Build the CUDA kernels when a CUDA toolkit is found" ON)
set(COMPCOMM_CUDA_ARCHITECTURES "90-real;90-virtual" CACHE STRING "CUDA architectures of the kernels")
option(COMPCOMM_CUDA_STATIC_RUNTIME "Link the CUDA runtime statically (no libcudart needed at run time)" ON)
set(COMPCOMM_CUDA OFF)
if(COMPCOMM_WITH_CUDA)
  # nvcc is often not on PATH (e.g. /usr/local/cuda/bin): point CMake at it so no environment
  # variable is needed.
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
    find_program(COMPCOMM_NVCC nvcc HINTS ENV CUDA_HOME ENV CUDA_PATH /usr/local/cuda PATH_SUFFIXES bin)
    if(COMPCOMM_NVCC)
      set(ENV{CUDACXX} "${COMPCOMM_NVCC}")
    endif()
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES "${COMPCOMM_CUDA_ARCHITECTURES}")
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit)
    if(CUDAToolkit_FOUND AND TARGET CUDA::cudart_static)
      set(COMPCOMM_CUDA ON)
      message(STATUS "compcomm: CUDA kernels ON (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, "
                     "architectures ${CMAKE_CUDA_ARCHITECTURES})")
    else()
      message(STATUS "compcomm: nvcc found but not the CUDA runtime library; CUDA kernels OFF")
    endif()
  else()
    message(STATUS "compcomm: no CUDA compiler found; CUDA kernels OFF (stub)")
  endif()
endif()
