// How it works (per rank r of W; ONEBIT_SPEC.md a.2 gives the exact numerics):
//
//   1. worker_scale_pack: sigma_r = ||m + e|| / sqrt(P) and the signs of x = m + e, packed MSB first, in
//      one read of m and e (the signs do not depend on sigma; only the workspace is written).
//   2. all_gather of a 32-byte Header {sigma, flags, n, P, dtype}. Every rank checks every header, so a
//      size mismatch or a non-finite input on any rank raises the same error on all ranks, before any
//      variable-sized exchange and before anything is written.
//   3. all_to_all sends chunk j of the signs to rank j.
//   4. Server on chunk r: c = sum_i s_i * sigma_i/W + server_error; tau_r = ||c|| / sqrt(C) and the
//      signs of c in one pass; they go out in one Record via all_gather.
//   5. Commit (only after every collective succeeded): server_error = c - tau s(c); worker error
//      e = x - sigma s(x) and the output m = tau_j s_j are written in one fused pass.
//
// The same code runs on host and device buffers: the kernels table picks the CPU twins or the CUDA
// kernels, and the only difference is where the header is validated (see compressed_allreduce.h).
// Deferring all writes to step 5 keeps the worker side at two passes over m and e (24 bytes per fp32
// element: read m, e; then read m, e and write e, m) and guarantees that a failed call (bad input on
// some rank, a timeout) changes nothing.
#include "compressed_allreduce.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/notice.h"
#include "poll.h"

namespace compcomm {
namespace {

constexpr uint32_t kHeaderMagic = 0xC0C0B175u;
// A compressed_reduce_scatter's header: its first collective is the same all_gather as an
// allreduce's, so a rank in one meeting a peer in the other raises instead of pairing with it.
constexpr uint32_t kScatterMagic = 0xC0C05CA7u;
// Other 32-byte records that can meet a header in the same all_gather when ranks are out of step:
// a batch's call count (compressed_allreduce_exchange_many) and compcomm._agree's layout check.
// Recognising them turns what would be a garbled exchange into RankMismatchError on every rank.
constexpr uint32_t kBatchMagic = 0xC0C0BA7Cu;
constexpr uint32_t kLayoutMagic = 0xC0C01A70u;  // = compcomm._agree._MAGIC
// A rank whose own arguments failed their checks sends this record instead of a header (compcomm.
// _agree.reject_exchange), so that its peers raise at once rather than wait for it or pair with its
// next call.
constexpr uint32_t kRejectMagic = 0xC0C0BAD5u;  // = compcomm._agree._REJECT_MAGIC
constexpr uint32_t kFlagNonFinite = 1u;
using Header = kernels::ExchangeHeader;
constexpr int64_t kRecordScaleBytes = 16;  // the fp32 tau, padded so the signs stay 16-byte aligned

int64_t align(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Bytes of one server record: the fp32 scale (padded) and the chunk's packed signs, 16-byte aligned.
int64_t record_bytes(int64_t chunk) { return kRecordScaleBytes + align(chunk / 8, 16); }

void check_padded(int64_t padded, int world, const char* name) {
  COMPCOMM_CHECK(world >= 1 && padded >= 0 && padded % (8 * world) == 0, name,
                 ": padded must be a multiple of 8*world");
}

struct Kernels {
  decltype(&kernels::cpu::worker_scale_pack_header) worker_scale_pack_header;
  decltype(&kernels::cpu::server_scale_pack) server_scale_pack;
  decltype(&kernels::cpu::commit) commit;
  decltype(&kernels::cpu::scale_workspace_bytes) scale_workspace_bytes;
  decltype(&kernels::cpu::decompress) decompress;
  decltype(&kernels::cpu::commit_gate) commit_gate;
  // the batched twins (exchange_many, commit_many): one launch per phase for all buckets on a GPU
  decltype(&kernels::cpu::batch_copy) batch_copy;
  decltype(&kernels::cpu::worker_scale_pack_header_many) worker_many;
  decltype(&kernels::cpu::server_scale_pack_many) server_many;
  decltype(&kernels::cpu::commit_many) commit_many;
  decltype(&kernels::cpu::commit_gate_many) commit_gate_many;
};

const Kernels& kernels_for(bool cuda) {
  namespace k = kernels;
  static const Kernels cpu{k::cpu::worker_scale_pack_header,
                           k::cpu::server_scale_pack,
                           k::cpu::commit,
                           k::cpu::scale_workspace_bytes,
                           k::cpu::decompress,
                           k::cpu::commit_gate,
                           k::cpu::batch_copy,
                           k::cpu::worker_scale_pack_header_many,
                           k::cpu::server_scale_pack_many,
                           k::cpu::commit_many,
                           k::cpu::commit_gate_many};
  static const Kernels gpu{k::cuda::worker_scale_pack_header,
                           k::cuda::server_scale_pack,
                           k::cuda::commit,
                           k::cuda::scale_workspace_bytes,
                           k::cuda::decompress,
                           k::cuda::commit_gate,
                           k::cuda::batch_copy,
                           k::cuda::worker_scale_pack_header_many,
                           k::cuda::server_scale_pack_many,
                           k::cuda::commit_many,
                           k::cuda::commit_gate_many};
  return cuda ? gpu : cpu;
}

void check_status(kernels::Status s, const char* kernel, int rank) {
  if (s == kernels::Status::kSuccess) return;
  if (s == kernels::Status::kNotBuilt)
    throw Unsupported(detail::concat("[rank ", rank, "] ", kernel,
                                     ": this build of compcomm has no CUDA kernels"),
                      kernel, "cuda", static_cast<int>(s), rank);
  throw BackendError(detail::concat("[rank ", rank, "] kernel ", kernel, " failed with status ",
                                    static_cast<int>(s)),
                     kernel, "kernels", static_cast<int>(s), rank);
}

// Pinned host memory for the device headers' copy (into pageable memory the copy is staged and
// slower): one block per thread, grown on demand, reused by every later call on that thread.
Header* pinned_headers(int64_t count, int rank) {
  struct Block {
    void* p = nullptr;
    int64_t bytes = 0;
    ~Block() { kernels::host_free(p); }
  };
  thread_local Block block;
  const int64_t need = std::max<int64_t>(4096, count * static_cast<int64_t>(sizeof(Header)));
  if (block.bytes < need) {
    void* p = nullptr;
    check_status(kernels::host_alloc(&p, need), "host_alloc", rank);
    kernels::host_free(block.p);
    block.p = p;
    block.bytes = need;
  }
  return static_cast<Header*>(block.p);
}

constexpr double kNoticeSpinS = 50e-6;  // how long wait_notice spins before it yields and polls

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// The notice a whole call alone waits on for its verdict (kernels.h, HeaderNotice): one per thread, so
// concurrent calls never share one. On a GPU it is page-locked host memory mapped into the devices,
// allocated once; on the host, plain memory (the same code path, so the CPU tests cover it). A call
// that launched its worker with a notice but did not read its verdict there (a timeout, a failure in
// between) abandons it (NoticeClaim): its worker kernel may still post there later, and the next
// call on this thread gets a fresh notice. Notices are never freed (a kernel may still write one): an
// abandoned call leaks 64 bytes on the host and a pinned mapped allocation (at least a page) with CUDA.
struct NoticeSlot {
  kernels::HeaderNotice* host = nullptr;    // read by this thread
  kernels::HeaderNotice* device = nullptr;  // written by the worker kernel
};

// Tags are unique per call in the process (not per notice), so no notice can hold a tag of a later
// call; they start at 1, the memory at 0.
std::atomic<uint64_t> notice_seq{0};

// nullptr where mapped memory cannot be had (a context without host mapping): the call then checks
// at its end with a stream sync, as before notices existed.
NoticeSlot* notice_slot(bool cuda) {
  thread_local kernels::HeaderNotice on_host{};
  thread_local NoticeSlot host_slot{&on_host, &on_host};
  thread_local NoticeSlot mapped;
  thread_local bool unavailable = false;
  if (!cuda) {
    if (host_slot.host == nullptr) {
      auto* fresh = new kernels::HeaderNotice{};  // the abandoned one is left as it is (see above)
      host_slot = NoticeSlot{fresh, fresh};
    }
    return &host_slot;
  }
  if (mapped.host == nullptr && !unavailable) {
    void *h = nullptr, *d = nullptr;
    if (kernels::host_alloc_mapped(&h, &d, sizeof(kernels::HeaderNotice)) != kernels::Status::kSuccess) {
      unavailable = true;
      return nullptr;
    }
    std::memset(h, 0, sizeof(kernels::HeaderNotice));
    mapped = NoticeSlot{static_cast<kernels::HeaderNotice*>(h), static_cast<kernels::HeaderNotice*>(d)};
  }
  return unavailable ? nullptr : &mapped;
}

// Held from the worker launch until the call has read its verdict from the notice: a call that
// leaves earlier (an exception) or could not trust what it read abandons the notice, so a kernel
// of this call that posts late never writes where a later call waits.
struct NoticeClaim {
  NoticeSlot* slot;
  explicit NoticeClaim(NoticeSlot* s) : slot(s) {}
  NoticeClaim(const NoticeClaim&) = delete;
  NoticeClaim& operator=(const NoticeClaim&) = delete;
  ~NoticeClaim() { abandon(); }
  void read() { slot = nullptr; }  // the worker posted and this call read it: nothing more comes
  void abandon() {
    if (slot != nullptr) *slot = NoticeSlot{};
    slot = nullptr;
  }
};

// memset/memcpy on host memory, their stream-ordered CUDA counterparts on device memory.
void fill(bool cuda, void* dst, int value, int64_t bytes, void* stream, int rank) {
  if (cuda)
    check_status(kernels::device_fill(dst, value, bytes, stream), "device_fill", rank);
  else
    std::memset(dst, value, static_cast<size_t>(bytes));
}

void copy(bool cuda, void* dst, const void* src, int64_t bytes, void* stream, int rank) {
  if (cuda)
    check_status(kernels::device_copy(dst, src, bytes, stream), "device_copy", rank);
  else
    std::memcpy(dst, src, static_cast<size_t>(bytes));
}

kernels::InputType input_type(DType t) {
  switch (t) {
    case DType::kFloat32: return kernels::InputType::kFloat32;
    case DType::kFloat16: return kernels::InputType::kFloat16;
    case DType::kBFloat16: return kernels::InputType::kBFloat16;
    default: break;
  }
  throw InvalidArgument(detail::concat("compressed_allreduce: tensor dtype ", dtype_name(t),
                                       " is not supported (float32, float16 or bfloat16)"));
}

// What a peer's 32-byte record says it is doing, when it is not `expected` (for errors).
std::string out_of_step(const Header* h, int world, uint32_t expected) {
  std::string who;
  for (int i = 0; i < world; ++i) {
    if (h[i].magic == expected) continue;
    if (h[i].magic == kHeaderMagic)
      who += detail::concat(who.empty() ? "" : ", ", "rank ", i, ": a compressed_allreduce call");
    else if (h[i].magic == kScatterMagic)
      who += detail::concat(who.empty() ? "" : ", ", "rank ", i, ": a compressed_reduce_scatter call");
    else if (h[i].magic == kBatchMagic)
      who += detail::concat(who.empty() ? "" : ", ", "rank ", i, ": a batch of ", h[i].numel, " calls");
    else if (h[i].magic == kLayoutMagic)
      who += detail::concat(who.empty() ? "" : ", ", "rank ", i, ": a layout check (its parameters or "
                            "buckets changed on that rank only)");
    else if (h[i].magic == kRejectMagic)
      who += detail::concat(who.empty() ? "" : ", ", "rank ", i, ": rejected its arguments (its own "
                            "TypeError or ValueError names them)");
    else
      return "";  // not a compcomm record: a malformed header
  }
  return who;
}

// Every rank sees every header, so every rank raises the same error.
void check_headers(const Header* h, int world, int rank, const Header& mine, const char* name) {
  bool mismatch = false, dtypes = false;
  std::vector<int> nonfinite;
  for (int i = 0; i < world; ++i) {
    if (h[i].magic != mine.magic && !out_of_step(h, world, mine.magic).empty())
      throw RankMismatchError(detail::concat("[rank ", rank, "] ", name, ": this rank passed one "
                                             "call, other ranks something else (",
                                             out_of_step(h, world, mine.magic), "); nothing was changed"),
                              name, "", 0, rank);
    if (h[i].magic != mine.magic)
      throw BackendError(detail::concat("[rank ", rank, "] ", name, ": rank ", i,
                                        " sent a malformed header (is every rank running compcomm?)"),
                         name, "", 0, rank);
    mismatch |= h[i].numel != mine.numel || h[i].padded != mine.padded || h[i].dtype != mine.dtype;
    dtypes |= h[i].dtype != mine.dtype;
    if (h[i].flags & kFlagNonFinite) nonfinite.push_back(i);
  }
  if (mismatch) {
    std::string sizes;  // only built for the error
    for (int i = 0; i < world; ++i)
      sizes += detail::concat(i ? ", " : "", "rank ", i, ": numel=", h[i].numel, " padded=", h[i].padded,
                              " dtype=", dtype_name(static_cast<DType>(h[i].dtype)));
    throw RankMismatchError(detail::concat("[rank ", rank, "] ", name, ": ranks passed "
                                           "different ", dtypes ? "tensor dtypes or sizes (" :
                                           "tensor or error-buffer sizes (",
                                           sizes, ")"),
                            name, "", 0, rank);
  }
  if (!nonfinite.empty()) {
    std::string who;
    for (size_t i = 0; i < nonfinite.size(); ++i) who += detail::concat(i ? ", " : "", nonfinite[i]);
    throw NonFiniteError(detail::concat("[rank ", rank, "] ", name, ": tensor + worker_error "
                                        "is not finite (NaN or Inf, or its norm overflows float32) on "
                                        "rank(s) ",
                                        who, "; nothing was changed"),
                         name, "", 0, rank);
  }
}

// Whether opts.check = false may skip the host check: only once this (communicator, numel, padded,
// dtype) has passed one, so that size mismatches are still reported.
using SeenKey = std::tuple<uint64_t, int64_t, int64_t, int32_t>;  // communicator id, n, P, dtype
std::mutex seen_mutex;
std::set<SeenKey> seen;

bool seen_before(const SeenKey& key) {
  std::lock_guard<std::mutex> lock(seen_mutex);
  return seen.count(key) != 0;
}

void remember(const SeenKey& key) {
  std::lock_guard<std::mutex> lock(seen_mutex);
  seen.insert(key);
}

// Test hooks, $COMPCOMM_TEST_FAULT (tests/test_nccl_abort.py), read at every call (tests set it
// late): "exit_after_header" makes this process exit (status 0) once its header went out, as a peer
// dying mid-call would; "no_commit_gate" leaves out the commit gate, so a test can show that its
// check fails without the gate.
bool test_fault(const char* name) {
  const char* fault = std::getenv("COMPCOMM_TEST_FAULT");
  return fault != nullptr && std::strcmp(fault, name) == 0;
}

void fault_point(const char* point, bool cuda, void* stream) {
  if (!test_fault(point)) return;
  if (cuda) kernels::stream_sync(stream);
  // What this rank sent may still sit in a transport's queue (NCCL's proxy thread): let it leave,
  // so the peers really get past this point before they find this rank gone.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::_Exit(0);
}

}  // namespace

uint64_t notice_address(bool cuda) {
  const NoticeSlot* slot = notice_slot(cuda);
  return slot != nullptr ? reinterpret_cast<uint64_t>(slot->host) : 0;
}

CompressedAllreduceLayout compressed_allreduce_layout(int64_t padded, int world, bool cuda) {
  COMPCOMM_CHECK(world >= 1 && padded >= 0, "compressed_allreduce_layout: bad padded/world");
  const int64_t chunk = padded / world;
  CompressedAllreduceLayout l{};
  l.record_bytes = record_bytes(chunk);
  l.record_scale_bytes = kRecordScaleBytes;
  int64_t off = 0;
  auto take = [&](int64_t bytes) {
    const int64_t at = off;
    off = align(off + bytes, 256);
    return at;
  };
  // The kernel scratch comes first, at a fixed offset: the GPU norm kernels need its ticket word to be
  // zero (they leave it zero), and a workspace reused for another size must not have put other data
  // there.
  const Kernels& k = kernels_for(cuda);
  l.scratch = take(static_cast<int64_t>(std::max(k.scale_workspace_bytes(padded),
                                                 k.scale_workspace_bytes(chunk))));
  l.header_send = take(sizeof(Header));
  if (world == 1) {
    // A world of one rank exchanges nothing: every receive region is its send region (the local
    // communicator's copies become no-ops). Extra memory: P/8 bytes plus a record.
    l.header_recv = l.header_send;
    l.signs_send = l.signs_recv = take(padded / 8);
    l.record_send = l.record_recv = take(l.record_bytes);
    l.total = off;
    return l;
  }
  l.header_recv = take(sizeof(Header) * world);
  // The received records reuse the sent signs' bytes: those are dead once the all_to_all returned (the
  // commit recomputes the worker signs from m and e). Extra memory is then (2 + 1/W) P/8 bytes: under
  // 10% of an fp32 tensor.
  l.signs_send = take(std::max(padded / 8, l.record_bytes * world));
  l.record_recv = l.signs_send;
  l.signs_recv = take(padded / 8);
  l.record_send = take(l.record_bytes);
  l.total = off;
  return l;
}

int64_t compressed_allreduce_wire_bytes(int64_t padded, int world) {
  check_padded(padded, world, "compressed_allreduce_wire_bytes");
  const int64_t header = static_cast<int64_t>(sizeof(Header));
  if (padded == 0) return (world - 1) * header;  // only the header exchange runs
  const int64_t chunk = padded / world;
  return (world - 1) * (header + chunk / 8 + record_bytes(chunk));
}

int64_t compressed_reduce_scatter_wire_bytes(int64_t padded, int world) {
  check_padded(padded, world, "compressed_reduce_scatter_wire_bytes");
  const int64_t header = static_cast<int64_t>(sizeof(Header));
  if (padded == 0) return (world - 1) * header;
  return (world - 1) * (header + padded / world / 8);
}

namespace {

// The one algorithm behind both entry points. out == nullptr: compressed allreduce (the records are
// all-gathered). Otherwise compressed reduce-scatter: no final all-gather; every rank's record but
// this rank's is taken as "+0" (so the commit writes +0 outside the own chunk) and `out` receives the
// own chunk.
// Which part of the call runs: kExchange does steps 1-4 (collectives, validation; writes only the
// workspace), kCommit step 5 (local writes, no communication) from a workspace an exchange filled.
enum Phase : int { kExchange = 1, kCommit = 2, kWhole = kExchange | kCommit };

// One call's validated arguments and workspace pointers, and its local steps. The collectives are
// run by the drivers below: one call at a time (run_compressed) or batched over several calls
// (compressed_allreduce_exchange_many), which runs the same local steps on the same workspaces.
struct Call {
  const char* name;
  Communicator& comm;
  int world, rank;
  int64_t n, padded, chunk;
  bool cuda;
  kernels::InputType itype;
  const Kernels* k;
  CompressedAllreduceLayout l;
  char* ws;
  Header *header, *headers;
  uint8_t *signs_send, *signs_recv;
  char *record, *records;
  void* scratch;
  void* m;
  float *e, *s;
  const Buffer* out;
  int32_t dtype;
  void* stream;
  Buffer ws_buf;
  SeenKey key;
  bool host_check;
  bool alone;  // a world of one rank whose collectives are copies (Communicator::alone): none run
  bool gate;   // CallOptions::gate, except in a whole call alone (see the constructor)
  const float* sigmas;
  int64_t sigma_stride;
  float* tau;
  uint8_t* packed;

  Call(const char* name_, Communicator& comm_, const Buffer& tensor, const Buffer& worker_error,
       const Buffer& server_error, const Buffer* out_, const Buffer& workspace, const CallOptions& opts,
       int phase)
      : name(name_), comm(comm_), world(comm_.size()), rank(comm_.rank()), n(tensor.count),
        padded(worker_error.count), cuda(!tensor.on_host()), itype(input_type(tensor.dtype)), out(out_),
        ws_buf(workspace) {
    COMPCOMM_CHECK(worker_error.dtype == DType::kFloat32 && server_error.dtype == DType::kFloat32,
                   "[rank ", rank, "] ", name, ": worker_error and server_error must be float32");
    COMPCOMM_CHECK(worker_error.device == tensor.device && server_error.device == tensor.device &&
                       workspace.device == tensor.device,
                   "[rank ", rank, "] ", name, ": tensor, worker_error, server_error and the workspace must be "
                   "on the same device");
    COMPCOMM_CHECK(padded >= n && padded % (8 * world) == 0, "[rank ", rank, "] ", name, ": worker_error has ",
                   padded, " elements; it needs a multiple of 8*world_size = ", 8 * world,
                   " that is >= tensor.numel() = ", n);
    COMPCOMM_CHECK(server_error.count * world == padded, "[rank ", rank, "] ", name, ": server_error has ",
                   server_error.count, " elements; it needs worker_error.numel() / world_size = ",
                   padded / world);
    COMPCOMM_CHECK(out == nullptr || (out->device == tensor.device && out->dtype == DType::kFloat32 &&
                                      out->count * world == padded),
                   "[rank ", rank, "] ", name, ": out must be a float32 buffer of worker_error.numel() / "
                   "world_size elements on tensor's device");
    l = compressed_allreduce_layout(padded, world, cuda);
    COMPCOMM_CHECK(workspace.bytes() >= l.total, "[rank ", rank, "] ", name, ": workspace has ",
                   workspace.bytes(), " bytes; it needs ", l.total);
    COMPCOMM_CHECK(!cuda || kernels::cuda::built(), "[rank ", rank, "] ", name,
                   ": tensor is on a CUDA device but this build has no CUDA kernels");
    k = &kernels_for(cuda);
    ws = static_cast<char*>(workspace.data);
    header = reinterpret_cast<Header*>(ws + l.header_send);
    headers = reinterpret_cast<Header*>(ws + l.header_recv);
    signs_send = reinterpret_cast<uint8_t*>(ws + l.signs_send);
    signs_recv = reinterpret_cast<uint8_t*>(ws + l.signs_recv);
    record = ws + l.record_send;
    records = ws + l.record_recv;
    scratch = ws + l.scratch;
    m = tensor.data;
    e = static_cast<float*>(worker_error.data);
    s = static_cast<float*>(server_error.data);
    chunk = padded / world;
    dtype = static_cast<int32_t>(tensor.dtype);
    stream = opts.stream;
    alone = comm.alone(tensor.device);
    // A whole call alone receives nothing an abort could cancel; a split call's commit may follow a
    // batched exchange that did run collectives, so it keeps the gate.
    gate = opts.gate && !(alone && phase == kWhole);
    key = SeenKey{comm.id(), n, padded, dtype};
    // A split call is always checked on the host, so its commit needs no device-side guard.
    host_check = !cuda || opts.check || phase != kWhole || !seen_before(key);
    sigmas = &headers[0].scale;
    sigma_stride = sizeof(Header) / sizeof(float);
    tau = reinterpret_cast<float*>(record);
    packed = reinterpret_cast<uint8_t*>(record + kRecordScaleBytes);
  }

  // 1. Worker scale and signs in one read of m and e (writes only the workspace), then the header --
  //    filled where it lives, so on GPU the scale never leaves the device -- and, with `notice`, posted
  //    there for a host thread waiting on it (wait_notice).
  void worker(kernels::HeaderNotice* notice = nullptr, uint64_t seq = 0) {
    check_status(k->worker_scale_pack_header(m, itype, n, e, padded, header, dtype, magic(), signs_send,
                                             scratch, stream, notice, seq),
                 "worker_scale_pack_header", rank);
  }

  // Whether a whole call alone can take its verdict from a notice: it must be checked on the host,
  // and its stream must run now (a stream being captured into a CUDA graph runs nothing: that call
  // keeps the stream sync at the end, which fails as it always did under capture).
  bool can_notify() {
    if (!host_check) return false;
    if (!cuda) return true;
    bool capturing = false;
    check_status(kernels::stream_capturing(stream, &capturing), "stream_capturing", rank);
    return !capturing;
  }

  // What this call's header says it is: an allreduce, or a reduce-scatter (given `out`).
  uint32_t magic() const { return out != nullptr ? kScatterMagic : kHeaderMagic; }

  // worker()'s launch as one job of a batch (worker_scale_pack_header_many, with magic()).
  kernels::WorkerJob worker_job() const {
    return kernels::WorkerJob{m, e, signs_send, scratch, header, n, padded, itype, dtype};
  }

  // 2, alone. Waits for the header the worker kernel posted in `slot` under tag `seq` and copies it to
  // `*h`; false if what it read cannot be trusted (torn by another writer, or not this call's sizes):
  // the caller then checks the header in the workspace after a stream sync (check()). Only the
  // worker's verdict is waited for, not the stream: the server kernel queued behind it keeps
  // running, and the caller queues the commit only after the verdict, so a call that raises
  // (NaN/Inf, a timeout) never writes tensor or errors. The stream is polled now and then, so that a
  // failed kernel raises rather than being waited for until the deadline.
  bool wait_notice(const NoticeSlot& slot, uint64_t seq, double timeout_s, Header* h) {
    fault_point("exit_after_header", cuda, stream);  // tests: as check()
    kernels::NoticeState state = kernels::read_notice(slot.host, seq, h);
    auto arrived = [&] {
      if (state == kernels::NoticeState::kPending) state = kernels::read_notice(slot.host, seq, h);
      return state != kernels::NoticeState::kPending;
    };
    if (!arrived()) {
      COMPCOMM_CHECK(cuda, "[rank ", rank, "] ", name, ": the worker pass posted no header");  // host: a bug
      // A small call's verdict comes within microseconds: spin on the tag alone first (a yield or a
      // stream query costs about as much as the wait), then poll as the other backends' waits do.
      const double spin_until = now_s() + kNoticeSpinS;
      for (int i = 1; !arrived(); ++i) {
        if (i % 256 == 0 && now_s() > spin_until) break;
        cpu_relax();
      }
    }
    if (!arrived()) {
      CountingBackoff pacer;
      int polls = 0;
      poll_until(
          pacer, now_s() + timeout_s,
          [&](bool*) {
            if (arrived()) return true;
            if (++polls % 64 != 0) return false;
            bool idle = false;
            check_status(kernels::stream_idle(stream, &idle), "stream_query", rank);
            if (idle && !arrived())
              throw BackendError(detail::concat("[rank ", rank, "] ", name, ": the worker kernel finished "
                                                "without posting its header"),
                                 name, "cuda", 0, rank);
            return idle;
          },
          [&] {
            throw TimeoutError(detail::concat("[rank ", rank, "] ", name, ": the worker kernel did not finish "
                                              "within ", timeout_s, " s (is the stream blocked by earlier "
                                              "work?); nothing was changed"),
                               name, "cuda", 0, rank);
          });
    }
    // Alone, the only header is this call's own: sizes, dtype and magic are known.
    return state == kernels::NoticeState::kReady && h->numel == n && h->padded == padded &&
           h->dtype == dtype && h->magic == magic();
  }

  // 2. Validate every rank's header (in `headers`) before any variable-sized exchange and before
  //    anything is written. Device headers are copied to the host for that, unless the caller opted
  //    out (see the header file).
  void check() {
    fault_point("exit_after_header", cuda, stream);  // tests: a rank that dies mid-exchange
    if (!host_check) return;
    if (cuda) {
      Header* host = pinned_headers(world, rank);
      check_status(kernels::device_copy(host, headers, sizeof(Header) * world, stream), "device_copy", rank);
      check_status(kernels::stream_sync(stream), "stream_sync", rank);
      // A watchdog abort (a peer died or never called) also ends the wait, with `headers` never
      // received: raise that timeout or failure, not a verdict on stale bytes.
      comm.check_open(name);
      check_host(host);
    } else {
      check_host(headers);
    }
  }

  // The verdict on every rank's header, `h` (world headers in host memory).
  void check_host(const Header* h) {
    check_headers(h, world, rank, Header{0.0f, 0u, n, padded, dtype, magic()}, name);
    if (cuda) remember(key);
  }

  // 4. Server reduction of chunk `rank` (scale and signs in one pass) into this rank's record. The
  //    record's padding bytes are never read; on the host they are zeroed so what is sent is defined.
  void server() {
    if (!cuda) std::memset(record, 0, static_cast<size_t>(l.record_bytes));
    check_status(k->server_scale_pack(signs_recv, sigmas, sigma_stride, world, s, chunk, tau, packed, scratch,
                                      stream),
                 "server_scale_pack", rank);
  }

  // server()'s launch as one job of a batch (server_scale_pack_many); on the host its record's
  // padding is zeroed here, as server() does.
  kernels::ServerJob server_job() const {
    if (!cuda) std::memset(record, 0, static_cast<size_t>(l.record_bytes));
    return kernels::ServerJob{signs_recv, sigmas, sigma_stride, s, chunk, tau, packed, scratch};
  }

  // Reduce-scatter: the other ranks' records read as scale +0, signs +1 (output +0 there).
  void local_records() {
    const int64_t sign_bytes = l.record_bytes - kRecordScaleBytes;
    for (int j = 0; j < world; ++j) {
      char* rec = records + j * l.record_bytes;
      if (j == rank) {
        if (rec != record) copy(cuda, rec, record, l.record_bytes, stream, rank);
      } else {
        fill(cuda, rec, 0, kRecordScaleBytes, stream, rank);
        fill(cuda, rec + kRecordScaleBytes, 0xFF, sign_bytes, stream, rank);
      }
    }
  }

  // 5. Commit. The commit kernels themselves skip the writes when any rank's server scale is not
  //    finite (without a host check, a non-finite worker scale on any rank makes every server scale
  //    so; with one, only an overflow of the server's sum can).
  void commit() {
    if (padded == 0) return;
    //    On a communicator that can cancel enqueued work (NCCL's watchdog abort), the gate first turns
    //    the received scales into NaN if it was cancelled: the collectives above may then have ended
    //    without their data, and the guard makes the commit write nothing rather than garbage.
    auto* taus = reinterpret_cast<float*>(records);
    const int64_t tau_stride = l.record_bytes / static_cast<int64_t>(sizeof(float));
    const int* abort_flag = gate ? comm.abort_flag() : nullptr;
    const bool no_gate = abort_flag != nullptr && test_fault("no_commit_gate");
    if (abort_flag != nullptr && !no_gate)
      check_status(k->commit_gate(abort_flag, taus, tau_stride, world, stream), "commit_gate", rank);
    // Guarded on every backend, checked on the host or not: a server scale that is not finite (an
    // overflow of c; the inputs were finite) then writes nothing everywhere, as the gate's NaN does.
    // (The test fault also drops the guard of a checked call, as before: the records an abort left
    // are arbitrary bytes, and the test shows that, ungated, they are written.)
    const float* guard = no_gate && host_check ? nullptr : taus;
    // (commit_job() below builds the same launch for a batch: keep the two in step)
    check_status(k->commit(signs_recv, sigmas, sigma_stride, s, tau, m, itype, n, e, padded, &header->scale, taus,
                           tau_stride, reinterpret_cast<const uint8_t*>(records + kRecordScaleBytes),
                           l.record_bytes, world, stream, guard, tau_stride),
                 "commit", rank);
    if (out != nullptr)
      check_status(k->decompress(tau, packed, chunk, static_cast<float*>(out->data), stream, guard, tau_stride,
                                 world),
                   "decompress", rank);
  }

  // After a whole allreduce's commit on the host: a server scale that is not finite (a server_error
  // holding NaN/Inf, or an overflow of the server's sum) made the guarded commit write nothing, so the
  // call raises rather than return as if it had averaged; the records are every rank's, so every rank
  // raises alike. Not a reduce-scatter: its rank sees only its own scale, and raising on that rank
  // alone would leave its peers in the caller's next exchange (FSDP's segment loop). On a GPU the
  // scales stay on the device (reading them would cost a second sync per call).
  void check_server_scales() const {
    if (cuda || padded == 0 || out != nullptr) return;
    // A cancelled exchange (the abort flag set) has its scales turned into NaN by the gate: not the
    // inputs' fault, and its error is the abort's, raised by the communicator.
    const int* abort_flag = comm.abort_flag();
    if (abort_flag != nullptr && *abort_flag != 0) return;
    std::string who;
    for (int j = 0; j < world; ++j) {
      float tau_j;
      std::memcpy(&tau_j, records + j * l.record_bytes, sizeof(float));
      if (!std::isfinite(tau_j)) who += detail::concat(who.empty() ? "" : ", ", j);
    }
    if (!who.empty())
      throw NonFiniteError(detail::concat("[rank ", rank, "] ", name, ": the server scale of the chunk(s) of "
                                          "rank(s) ", who, " is not finite (that rank's server_error holds NaN "
                                          "or Inf, or its sum overflows float32); nothing was changed"),
                           name, "", 0, rank);
  }

  // commit() of an allreduce (out == nullptr) as jobs of a batch: the gate of its record's scales
  // and the commit launch, whose guard is commit()'s (no_gate: commit()'s, for the caller's flag).
  kernels::GateJob gate_job() const {
    return kernels::GateJob{reinterpret_cast<float*>(records), l.record_bytes / static_cast<int64_t>(sizeof(float))};
  }
  kernels::CommitJob commit_job(bool no_gate) const {
    const int64_t tau_stride = l.record_bytes / static_cast<int64_t>(sizeof(float));
    const auto* taus = reinterpret_cast<const float*>(records);
    return kernels::CommitJob{signs_recv, sigmas, sigma_stride, s, tau, m, n, e, padded, &header->scale, taus,
                              tau_stride, reinterpret_cast<const uint8_t*>(records + kRecordScaleBytes),
                              l.record_bytes, no_gate && host_check ? nullptr : taus, tau_stride, itype};
  }
};

void run_compressed(const char* name, Communicator& comm, const Buffer& tensor, const Buffer& worker_error,
                    const Buffer& server_error, const Buffer* out, const Buffer& workspace,
                    const CallOptions& opts, int phase = kWhole) {
  Call c(name, comm, tensor, worker_error, server_error, out, workspace, opts, phase);
  const kernels::ScopedDevice on_device(tensor.device);  // callers may be on any thread and device
  const CompressedAllreduceLayout& l = c.l;
  // Alone (one rank, collectives that are copies), every receive region of the layout is its send
  // region, so no collective runs, and the header check needs no stream sync: the worker kernel posts
  // its header to (mapped) host memory, the host waits for that verdict while the server kernel runs,
  // and only then queues the commit; the call returns without a device-to-host copy or a sync
  // (Call::wait_notice; on the host it is the same code, tested there). A call that raises has queued
  // no commit, so it wrote nothing. Unchecked (check = false, sizes seen) or under graph capture, the
  // check stays at the end (a no-op, or the sync capture rejects): a non-finite worker scale makes
  // the server scale non-finite too, so the guarded commit writes nothing.
  const bool defer = c.alone && phase == kWhole;
  NoticeSlot* slot = defer && c.can_notify() ? notice_slot(c.cuda) : nullptr;
  const uint64_t seq = slot != nullptr ? ++notice_seq : 0;
  NoticeClaim claim(slot);
  if (phase & kExchange) {
    if (c.alone) comm.check_open(name);  // a closed communicator still raises
    c.worker(slot != nullptr ? slot->device : nullptr, seq);
    if (slot != nullptr && test_fault("raise_after_worker"))  // tests: a failure after the launch
      throw BackendError(detail::concat("[rank ", c.rank, "] ", name, ": test fault raise_after_worker"),
                         name, "", 0, c.rank);
    if (!c.alone)
      comm.all_gather(c.ws_buf.reinterpret(DType::kUInt8, l.header_send, sizeof(Header)),
                      c.ws_buf.reinterpret(DType::kUInt8, l.header_recv, sizeof(Header) * c.world), opts);
    if (!defer) c.check();
    if (c.padded != 0) {
      // 3. Worker signs to their server ranks.
      if (!c.alone)
        comm.all_to_all(c.ws_buf.reinterpret(DType::kUInt8, l.signs_send, c.padded / 8),
                        c.ws_buf.reinterpret(DType::kUInt8, l.signs_recv, c.padded / 8), opts);
      c.server();
      if (out != nullptr)
        c.local_records();
      else if (!c.alone)
        comm.all_gather(c.ws_buf.reinterpret(DType::kUInt8, l.record_send, l.record_bytes),
                        c.ws_buf.reinterpret(DType::kUInt8, l.record_recv, l.record_bytes * c.world), opts);
    }
  }
  if (slot != nullptr) {
    Header h;
    if (c.wait_notice(*slot, seq, opts.timeout_s, &h)) {
      claim.read();
      c.check_host(&h);
    } else {
      claim.abandon();  // another writer was there: this thread's next call takes a fresh notice
      c.check();
    }
  }
  if (phase & kCommit) c.commit();  // nothing to write when padded == 0
  if (defer && slot == nullptr) c.check();
  if (phase == kWhole) c.check_server_scales();
}

// The staging of a batched exchange (byte offsets, each 256-byte aligned): headers, signs and records
// of every call side by side, so each of the three exchanges is one collective.
struct BatchLayout {
  int64_t count_send, count_recv;  // each rank's number of calls (a kBatchMagic record), exchanged first
  int64_t header_send, header_recv, signs_send, signs_recv, record_send, record_recv, total;
  int64_t signs_per_rank;   // bytes each rank sends each peer: sum of chunk/8
  int64_t records_per_rank;  // sum of record bytes
};

BatchLayout batch_layout(const std::vector<int64_t>& paddeds, int world) {
  BatchLayout b{};
  const int64_t calls = static_cast<int64_t>(paddeds.size());
  for (int64_t p : paddeds) {
    check_padded(p, world, "compressed_allreduce_exchange_many");
    if (p == 0) continue;
    b.signs_per_rank += p / world / 8;
    b.records_per_rank += record_bytes(p / world);
  }
  int64_t off = 0;
  auto take = [&](int64_t bytes) {
    const int64_t at = off;
    off = align(off + bytes, 256);
    return at;
  };
  b.count_send = take(sizeof(Header));  // a header-sized record: see kBatchMagic
  b.count_recv = take(sizeof(Header) * world);
  b.header_send = take(calls * static_cast<int64_t>(sizeof(Header)));
  b.header_recv = take(calls * world * static_cast<int64_t>(sizeof(Header)));
  b.signs_send = take(b.signs_per_rank * world);
  b.signs_recv = take(b.signs_per_rank * world);
  b.record_send = take(b.records_per_rank);
  b.record_recv = take(b.records_per_rank * world);
  b.total = off;
  return b;
}

}  // namespace

void compressed_allreduce(Communicator& comm, const Buffer& tensor, const Buffer& worker_error,
                          const Buffer& server_error, const Buffer& workspace, const CallOptions& opts) {
  run_compressed("compressed_allreduce", comm, tensor, worker_error, server_error, nullptr, workspace, opts);
}

void compressed_reduce_scatter(Communicator& comm, const Buffer& tensor, const Buffer& worker_error,
                               const Buffer& server_error, const Buffer& out, const Buffer& workspace,
                               const CallOptions& opts) {
  run_compressed("compressed_reduce_scatter", comm, tensor, worker_error, server_error, &out, workspace, opts);
}

void compressed_allreduce_exchange(Communicator& comm, const Buffer& tensor, const Buffer& worker_error,
                                   const Buffer& server_error, const Buffer& workspace, const CallOptions& opts) {
  run_compressed("compressed_allreduce", comm, tensor, worker_error, server_error, nullptr, workspace, opts,
                 kExchange);
}

void compressed_allreduce_commit(Communicator& comm, const Buffer& tensor, const Buffer& worker_error,
                                 const Buffer& server_error, const Buffer& workspace, const CallOptions& opts) {
  run_compressed("compressed_allreduce", comm, tensor, worker_error, server_error, nullptr, workspace, opts,
                 kCommit);
}

void compressed_reduce_scatter_exchange(Communicator& comm, const Buffer& tensor, const Buffer& worker_error,
                                        const Buffer& server_error, const Buffer& out, const Buffer& workspace,
                                        const CallOptions& opts) {
  run_compressed("compressed_reduce_scatter", comm, tensor, worker_error, server_error, &out, workspace, opts,
                 kExchange);
}

void compressed_reduce_scatter_commit(Communicator& comm, const Buffer& tensor, const Buffer& worker_error,
                                      const Buffer& server_error, const Buffer& out, const Buffer& workspace,
                                      const CallOptions& opts) {
  run_compressed("compressed_reduce_scatter", comm, tensor, worker_error, server_error, &out, workspace, opts,
                 kCommit);
}

int64_t compressed_allreduce_batch_bytes(const std::vector<int64_t>& paddeds, int world) {
  COMPCOMM_CHECK(world >= 1, "compressed_allreduce_batch_bytes: world must be >= 1");
  return batch_layout(paddeds, world).total;
}

// How it works: every call's local steps run on its own workspace exactly as in a single
// compressed_allreduce_exchange (so the results, the error updates and a later
// compressed_allreduce_commit are bit for bit those of per-call exchanges); only the three exchanges
// are batched: the headers of all calls in one all_gather, the signs in one all_to_all (per peer: each
// call's chunk for it, in call order), the server records in one all_gather. The staging copies move
// P/8 bytes per call each way, a small fraction of the kernels' passes over the fp32 data. The local
// steps and copies of all calls are batched too (kernels.h, "batches": on a GPU one launch per phase,
// each call on the blocks of its own launch, so the same bits), as the commits are in
// compressed_allreduce_commit_many.
namespace {
// The batched exchange of compressed_allreduce_exchange_many, and of
// compressed_reduce_scatter_exchange_many when `outs` is given (then no record all_gather: every
// call's records are filled locally, as a single reduce-scatter's are).
void exchange_many(const char* name, Communicator& comm, const std::vector<Buffer>& tensors,
                   const std::vector<Buffer>& worker_errors, const std::vector<Buffer>& server_errors,
                   const std::vector<Buffer>* outs, const std::vector<Buffer>& workspaces,
                   const Buffer& staging, const CallOptions& opts) {
  const int world = comm.size(), rank = comm.rank();
  const size_t calls = tensors.size();
  COMPCOMM_CHECK(worker_errors.size() == calls && server_errors.size() == calls && workspaces.size() == calls &&
                     (outs == nullptr || outs->size() == calls),
                 "[rank ", rank, "] ", name, ": tensors, worker_errors, server_errors, workspaces (and outs) "
                 "must have the same length (", calls, ", ", worker_errors.size(), ", ", server_errors.size(),
                 ", ", workspaces.size(), ")");
  std::vector<Call> cs;
  cs.reserve(calls);
  std::vector<int64_t> paddeds;
  for (size_t i = 0; i < calls; ++i) {
    COMPCOMM_CHECK(tensors[i].device == tensors[0].device, "[rank ", rank, "] ", name, ": tensors[", i,
                   "] is on another device than tensors[0]");
    cs.emplace_back(name, comm, tensors[i], worker_errors[i], server_errors[i],
                    outs != nullptr ? &(*outs)[i] : nullptr, workspaces[i], opts, kExchange);
    paddeds.push_back(cs.back().padded);
  }
  const bool cuda = calls > 0 ? cs[0].cuda : !staging.on_host();
  const BatchLayout b = batch_layout(paddeds, world);
  COMPCOMM_CHECK(calls == 0 || staging.device == tensors[0].device, "[rank ", rank, "] ", name,
                 ": staging must be on the tensors' device");
  COMPCOMM_CHECK(staging.bytes() >= b.total, "[rank ", rank, "] ", name, ": staging must have at least ",
                 b.total, " bytes (compressed_allreduce_batch_bytes); it has ", staging.bytes());
  const kernels::ScopedDevice on_device(staging.device);
  char* st = static_cast<char*>(staging.data);
  void* stream = opts.stream;
  const int64_t hb = sizeof(Header), nc = static_cast<int64_t>(calls);
  auto put = [&](void* dst, const void* src, int64_t bytes) { copy(cuda, dst, src, bytes, stream, rank); };
  // The per-bucket copies of each phase go in one batch_copy (one launch on a GPU, not one
  // cudaMemcpyAsync per copy: those cost ~10 us of host time each).
  const Kernels& k = kernels_for(cuda);
  std::vector<kernels::CopyJob> copies;
  auto queue = [&](void* dst, const void* src, int64_t bytes) {
    if (bytes > 0) copies.push_back(kernels::CopyJob{src, dst, bytes});
  };
  auto flush = [&] {
    check_status(k.batch_copy(copies.data(), static_cast<int64_t>(copies.size()), stream), "batch_copy", rank);
    copies.clear();
  };
  auto sync = [&] {  // device results to the host; an abort that ended the wait raises here
    if (!cuda) return;
    check_status(kernels::stream_sync(stream), "stream_sync", rank);
    comm.check_open(name);
  };

  // 0. Every rank's number of calls, in a collective of fixed size: the header exchange's size
  //    depends on it, and mismatched sizes hang (or worse) on NCCL.
  //    The count travels in a record of a header's size and kind (kBatchMagic), so that a peer
  //    in a single call or a layout check, whose first collective is a 32-byte all_gather too,
  //    raises RankMismatchError on both sides instead of garbling the exchange.
  std::vector<Header> counts(static_cast<size_t>(world), Header{0.0f, 0u, nc, 0, 0, kBatchMagic});
  if (world > 1) {
    put(st + b.count_send, counts.data(), hb);
    comm.all_gather(staging.reinterpret(DType::kUInt8, b.count_send, hb),
                    staging.reinterpret(DType::kUInt8, b.count_recv, hb * world), opts);
  }
  // 1. Worker passes (only the workspaces are written), queued behind that exchange on a GPU.
  {
    std::vector<kernels::WorkerJob> jobs;
    for (const Call& c : cs) jobs.push_back(c.worker_job());
    // (every call of a batch is of one kind: all reduce-scatters when `outs` is given)
    const uint32_t magic = cs.empty() ? kHeaderMagic : cs.front().magic();
    check_status(k.worker_many(jobs.data(), nc, magic, stream), "worker_scale_pack_header_many", rank);
  }
  for (size_t i = 0; i < calls; ++i) queue(st + b.header_send + i * hb, cs[i].header, hb);
  flush();
  if (world > 1) {
    put(counts.data(), st + b.count_recv, hb * world);
    sync();
    const std::string other = out_of_step(counts.data(), world, kBatchMagic);
    if (!other.empty())
      throw RankMismatchError(detail::concat("[rank ", rank, "] ", name, ": this rank passed a batch of ", nc,
                                             " calls, other ranks something else (", other, ")"),
                              name, "", 0, rank);
    for (int r = 0; r < world; ++r)
      if (counts[r].magic != kBatchMagic)
        throw BackendError(detail::concat("[rank ", rank, "] ", name, ": rank ", r, " sent a malformed call "
                                          "count (is every rank running compcomm?)"),
                           name, "", 0, rank);
    if (std::any_of(counts.begin(), counts.end(), [&](const Header& c) { return c.numel != nc; })) {
      std::string who;  // only built for the error
      for (int r = 0; r < world; ++r) who += detail::concat(r ? ", " : "", "rank ", r, ": ", counts[r].numel);
      throw RankMismatchError(detail::concat("[rank ", rank, "] ", name, ": ranks passed different numbers "
                                             "of calls (", who, ")"),
                              name, "", 0, rank);
    }
  }
  if (calls == 0) return;

  // 2. Every call's header in one all_gather, each call's headers into its workspace (its commit
  //    reads them there); validated per call from one host copy of the whole block (one sync).
  comm.all_gather(staging.reinterpret(DType::kUInt8, b.header_send, nc * hb),
                  staging.reinterpret(DType::kUInt8, b.header_recv, nc * hb * world), opts);
  for (size_t i = 0; i < calls; ++i)
    for (int r = 0; r < world; ++r) queue(cs[i].headers + r, st + b.header_recv + (r * nc + i) * hb, hb);
  flush();
  fault_point("exit_after_header", cuda, stream);  // tests: a rank that dies mid-exchange
  std::vector<Header> gathered;  // the received block, rank-major: call i of rank r at r * nc + i
  const Header* block = reinterpret_cast<const Header*>(st + b.header_recv);
  if (cuda) {
    gathered.resize(static_cast<size_t>(nc * world));
    put(gathered.data(), block, nc * hb * world);
    sync();
    block = gathered.data();
  }
  std::vector<Header> own(static_cast<size_t>(world));
  for (size_t i = 0; i < calls; ++i) {  // every call here is checked on the host (a split call)
    for (int r = 0; r < world; ++r) own[r] = block[r * nc + static_cast<int64_t>(i)];
    cs[i].check_host(own.data());
  }
  if (b.signs_per_rank == 0) return;  // every call is empty: only the headers ran, as per call

  // 3. Signs: to peer j, every call's chunk j in call order; back into each call's workspace.
  int64_t off = 0;
  for (Call& c : cs) {
    const int64_t cb = c.chunk / 8;
    for (int j = 0; j < world && cb > 0; ++j)
      queue(st + b.signs_send + j * b.signs_per_rank + off, c.signs_send + j * cb, cb);
    off += cb;
  }
  flush();
  comm.all_to_all(staging.reinterpret(DType::kUInt8, b.signs_send, b.signs_per_rank * world),
                  staging.reinterpret(DType::kUInt8, b.signs_recv, b.signs_per_rank * world), opts);
  off = 0;
  for (Call& c : cs) {
    const int64_t cb = c.chunk / 8;
    for (int j = 0; j < world && cb > 0; ++j)
      queue(c.signs_recv + j * cb, st + b.signs_recv + j * b.signs_per_rank + off, cb);
    off += cb;
  }
  flush();

  // 4. Server passes, then every call's record in one all_gather.
  {
    std::vector<kernels::ServerJob> jobs;
    for (const Call& c : cs)
      if (c.padded != 0) jobs.push_back(c.server_job());
    check_status(k.server_many(jobs.data(), static_cast<int64_t>(jobs.size()), world, stream), "server_scale_pack_many",
                 rank);
  }
  if (outs != nullptr) {  // reduce-scatter: no records travel
    for (Call& c : cs)
      if (c.padded != 0) c.local_records();
    return;
  }
  off = 0;
  for (Call& c : cs) {
    if (c.padded == 0) continue;
    queue(st + b.record_send + off, c.record, c.l.record_bytes);
    off += c.l.record_bytes;
  }
  flush();
  comm.all_gather(staging.reinterpret(DType::kUInt8, b.record_send, b.records_per_rank),
                  staging.reinterpret(DType::kUInt8, b.record_recv, b.records_per_rank * world), opts);
  off = 0;
  for (Call& c : cs) {
    if (c.padded == 0) continue;
    for (int j = 0; j < world; ++j)
      queue(c.records + j * c.l.record_bytes, st + b.record_recv + j * b.records_per_rank + off, c.l.record_bytes);
    off += c.l.record_bytes;
  }
  flush();
}

}  // namespace

void compressed_allreduce_exchange_many(Communicator& comm, const std::vector<Buffer>& tensors,
                                        const std::vector<Buffer>& worker_errors,
                                        const std::vector<Buffer>& server_errors,
                                        const std::vector<Buffer>& workspaces, const Buffer& staging,
                                        const CallOptions& opts) {
  exchange_many("compressed_allreduce_exchange_many", comm, tensors, worker_errors, server_errors, nullptr,
                workspaces, staging, opts);
}

void compressed_reduce_scatter_exchange_many(Communicator& comm, const std::vector<Buffer>& tensors,
                                             const std::vector<Buffer>& worker_errors,
                                             const std::vector<Buffer>& server_errors,
                                             const std::vector<Buffer>& outs,
                                             const std::vector<Buffer>& workspaces, const Buffer& staging,
                                             const CallOptions& opts) {
  exchange_many("compressed_reduce_scatter_exchange_many", comm, tensors, worker_errors, server_errors, &outs,
                workspaces, staging, opts);
}

// Every call's commit() in three launches at most (the gates, then the commits; more only past a
// kernel argument pack, ~27 buckets per commit launch), validated first: a bad argument of any call
// raises before anything is written.
void compressed_allreduce_commit_many(Communicator& comm, const std::vector<Buffer>& tensors,
                                      const std::vector<Buffer>& worker_errors,
                                      const std::vector<Buffer>& server_errors,
                                      const std::vector<Buffer>& workspaces, const CallOptions& opts) {
  const char* name = "compressed_allreduce_commit_many";
  const int rank = comm.rank();
  const size_t calls = tensors.size();
  COMPCOMM_CHECK(worker_errors.size() == calls && server_errors.size() == calls && workspaces.size() == calls,
                 "[rank ", rank, "] ", name, ": tensors, worker_errors, server_errors and workspaces must have "
                 "the same length (", calls, ", ", worker_errors.size(), ", ", server_errors.size(), ", ",
                 workspaces.size(), ")");
  if (calls == 0) return;
  std::vector<Call> cs;
  cs.reserve(calls);
  for (size_t i = 0; i < calls; ++i) {
    COMPCOMM_CHECK(tensors[i].device == tensors[0].device, "[rank ", rank, "] ", name, ": tensors[", i,
                   "] is on another device than tensors[0]");
    cs.emplace_back("compressed_allreduce", comm, tensors[i], worker_errors[i], server_errors[i], nullptr,
                    workspaces[i], opts, kCommit);
  }
  const kernels::ScopedDevice on_device(tensors[0].device);
  const Kernels& k = *cs[0].k;
  // as commit() (a split call's gate is opts.gate), the flag asked for once, not per call
  const int* abort_flag = opts.gate ? comm.abort_flag() : nullptr;
  const bool no_gate = abort_flag != nullptr && test_fault("no_commit_gate");
  std::vector<kernels::GateJob> gates;
  std::vector<kernels::CommitJob> jobs;
  for (const Call& c : cs) {
    if (c.padded == 0) continue;  // nothing to write, as commit()
    if (abort_flag != nullptr && !no_gate) gates.push_back(c.gate_job());
    jobs.push_back(c.commit_job(no_gate));
  }
  if (!gates.empty())
    check_status(k.commit_gate_many(abort_flag, gates.data(), static_cast<int64_t>(gates.size()), cs[0].world,
                                    opts.stream),
                 "commit_gate_many", rank);
  check_status(k.commit_many(jobs.data(), static_cast<int64_t>(jobs.size()), cs[0].world, opts.stream), "commit_many",
               rank);
}

}  // namespace compcomm
