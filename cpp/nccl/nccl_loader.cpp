#include "nccl_loader.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <utility>
#include <vector>

#include "nccl_comm.h"

namespace compcomm::nccl {

namespace {

std::mutex g_load_mu;
const Api* g_api = nullptr;  // set once, never freed (the library stays loaded)

template <class F>
bool resolve(void* handle, const char* name, F& fn, std::string& missing) {
  fn = reinterpret_cast<F>(dlsym(handle, name));
  if (!fn) missing += std::string(missing.empty() ? "" : ", ") + name;
  return fn != nullptr;
}

// Fills `api` from `handle`; returns the names it could not find ("" if none).
std::string resolve_all(void* handle, Api& a) {
  std::string missing;
  resolve(handle, "ncclGetVersion", a.GetVersion, missing);
  resolve(handle, "ncclGetUniqueId", a.GetUniqueId, missing);
  resolve(handle, "ncclCommInitRankConfig", a.CommInitRankConfig, missing);
  resolve(handle, "ncclCommFinalize", a.CommFinalize, missing);
  resolve(handle, "ncclCommDestroy", a.CommDestroy, missing);
  resolve(handle, "ncclCommAbort", a.CommAbort, missing);
  resolve(handle, "ncclCommGetAsyncError", a.CommGetAsyncError, missing);
  resolve(handle, "ncclGetErrorString", a.GetErrorString, missing);
  resolve(handle, "ncclGetLastError", a.GetLastError, missing);
  resolve(handle, "ncclAllReduce", a.AllReduce, missing);
  resolve(handle, "ncclBroadcast", a.Broadcast, missing);
  resolve(handle, "ncclAllGather", a.AllGather, missing);
  resolve(handle, "ncclReduceScatter", a.ReduceScatter, missing);
  resolve(handle, "ncclSend", a.Send, missing);
  resolve(handle, "ncclRecv", a.Recv, missing);
  resolve(handle, "ncclGroupStart", a.GroupStart, missing);
  resolve(handle, "ncclGroupEnd", a.GroupEnd, missing);
  return missing;
}

}  // namespace

const Api& api() {
  if (!g_api) load();
  return *g_api;
}

std::string nccl_text(int result, void* comm) {
  const Api& a = api();
  std::string s = a.GetErrorString(static_cast<ncclResult_t>(result));
  const char* last = a.GetLastError(as_comm(comm));
  if (last && *last) s += std::string(": ") + last;
  return s;
}

std::string load(const std::vector<std::string>& candidates) {
  std::lock_guard<std::mutex> lock(g_load_mu);
  if (g_api) return g_api->path;
  std::vector<std::pair<std::string, int>> tries;  // (name, dlopen flags)
  if (const char* env = std::getenv("COMPCOMM_NCCL_LIBRARY"); env && *env)
    tries.push_back({env, 0});
  tries.push_back({"libnccl.so.2", RTLD_NOLOAD});  // already in the process (torch's copy)
  for (const auto& c : candidates) tries.push_back({c, 0});
  tries.push_back({"libnccl.so.2", 0});  // the dynamic linker's search path (a system NCCL)
  std::string tried;
  for (const auto& [name, flags] : tries) {
    void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL | flags);
    if (!h) {
      if (!(flags & RTLD_NOLOAD)) {
        const char* err = dlerror();
        tried += "\n  " + name + ": " + (err ? err : "not found");
      }
      continue;
    }
    auto* a = new Api{};
    const std::string missing = resolve_all(h, *a);
    if (!missing.empty()) {
      tried += "\n  " + name + ": lacks " + missing + " (NCCL >= 2.14 is needed)";
      delete a;
      dlclose(h);
      continue;
    }
    Dl_info info{};
    a->path = dladdr(reinterpret_cast<void*>(a->GetVersion), &info) && info.dli_fname
                  ? info.dli_fname
                  : name;
    g_api = a;
    return a->path;
  }
  throw Unsupported("NCCL library not found; tried:" + tried +
                        "\nInstall torch with CUDA (it ships NCCL) or nvidia-nccl-cu13, or set "
                        "COMPCOMM_NCCL_LIBRARY to libnccl.so.2",
                    "load", "nccl", 0, -1);
}

bool loaded() {
  std::lock_guard<std::mutex> lock(g_load_mu);
  return g_api != nullptr;
}

int runtime_version() {
  int v = 0;
  const ncclResult_t r = api().GetVersion(&v);
  if (r != ncclSuccess)
    throw BackendError("ncclGetVersion failed: " + nccl_text(r, nullptr), "version", "nccl", r);
  return v;
}

std::string unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = api().GetUniqueId(&id);
  if (r != ncclSuccess)
    throw BackendError("ncclGetUniqueId failed: " + nccl_text(r, nullptr), "unique_id", "nccl", r);
  static_assert(sizeof(id.internal) == kUniqueIdBytes, "NCCL_UNIQUE_ID_BYTES changed");
  return std::string(id.internal, sizeof(id.internal));
}

}  // namespace compcomm::nccl
