// Run-time loading of libnccl.so.2 for the NCCL communicator (internal to cpp/nccl/): the library
// is never linked; load() (declared in nccl_comm.h) dlopen()s it and resolves the few functions used
// into a table, so the package builds and imports on machines without NCCL.
#pragma once

#include <nccl.h>

#include <string>

namespace compcomm::nccl {

// The NCCL functions the communicator uses, resolved from the run-time library. Types come from the
// build-time header; only functions present since NCCL 2.14 are used.
struct Api {
  decltype(&::ncclGetVersion) GetVersion;
  decltype(&::ncclGetUniqueId) GetUniqueId;
  decltype(&::ncclCommInitRankConfig) CommInitRankConfig;
  decltype(&::ncclCommFinalize) CommFinalize;
  decltype(&::ncclCommDestroy) CommDestroy;
  decltype(&::ncclCommAbort) CommAbort;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&::ncclGetErrorString) GetErrorString;
  decltype(&::ncclGetLastError) GetLastError;
  decltype(&::ncclAllReduce) AllReduce;
  decltype(&::ncclBroadcast) Broadcast;
  decltype(&::ncclAllGather) AllGather;
  decltype(&::ncclReduceScatter) ReduceScatter;
  decltype(&::ncclSend) Send;
  decltype(&::ncclRecv) Recv;
  decltype(&::ncclGroupStart) GroupStart;
  decltype(&::ncclGroupEnd) GroupEnd;
  std::string path;
};

// The table of the loaded library; loads it (load() without candidates) on first use.
const Api& api();

// "<NCCL's string for the code>: <NCCL's last error message>" (`comm` may be null).
std::string nccl_text(int result, void* comm);

inline ncclComm_t as_comm(void* c) { return static_cast<ncclComm_t>(c); }

}  // namespace compcomm::nccl
