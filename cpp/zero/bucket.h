// Bucket planning and bucketed reduce-scatter / all-gather for ZeRO, written once against
// Communicator.
//
// Layout. A list of tensors (sizes n_0..n_{T-1}, in order) is flattened into one buffer cut into
// buckets. A bucket holds consecutive tensors whose sizes sum to at most `bucket_size` elements (a
// tensor larger than that gets a bucket of its own; bucket_size <= 0 puts every tensor in its own
// bucket, which is ZeRO-3's per-parameter partitioning). Each bucket is zero-padded to a multiple of
// world * alignment elements and split into `world` equal chunks: rank r owns chunk r of every
// bucket. Rank r's shard is the concatenation of its chunks, so it is one contiguous buffer whose size
// is about 1/world of the flat buffer (plus at most world*alignment-1 padding per bucket), and the
// reduce-scatter / all-gather of one bucket is a plain equal-chunk collective on a contiguous range of
// the flat buffer with no staging copy.
//
// Asynchrony (overlap_comm). An AsyncComm owns one worker thread per communicator and runs submitted
// collectives in submission order, so every rank issues them in the same order while the caller's
// thread keeps computing (backward). The caller waits on the returned Work handle. Only one thread may
// issue collectives on the communicator while work is pending: the caller must not call the
// communicator directly until it has waited for everything it submitted.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "../comm.h"

namespace compcomm::zero {

struct TensorSlot {
  int64_t numel;   // elements of the tensor
  int64_t offset;  // where it starts in the flat buffer
  int bucket;      // the bucket that holds it
};

struct BucketSlot {
  int64_t offset;        // where the bucket starts in the flat buffer
  int64_t numel;         // elements of tensors in it (unpadded)
  int64_t padded;        // numel rounded up to a multiple of world * alignment
  int64_t chunk;         // padded / world: elements each rank owns
  int64_t shard_offset;  // where this bucket's chunk starts in every rank's shard
  int first_tensor, last_tensor;  // tensors [first, last) live here
};

struct BucketPlan {
  int world = 1;
  int64_t alignment = 1;
  int64_t bucket_size = 0;
  std::vector<TensorSlot> tensors;
  std::vector<BucketSlot> buckets;
  int64_t flat_numel = 0;   // sum of padded bucket sizes
  int64_t shard_numel = 0;  // flat_numel / world
};

// Plans the layout described above. sizes >= 0; world >= 1; alignment >= 1.
BucketPlan plan_buckets(const std::vector<int64_t>& sizes, int64_t bucket_size, int world,
                        int64_t alignment);

// For every bucket b in [first, last): shard[b.shard_offset, +chunk) = op over ranks of the chunk
// `rank` of flat[b.offset, +padded). flat has plan.flat_numel elements, shard plan.shard_numel, of
// the same dtype.
void bucketed_reduce_scatter(Communicator& comm, const BucketPlan& plan, const Buffer& flat,
                             const Buffer& shard, int first, int last, ReduceOp op,
                             const CallOptions& opts);

// The inverse: for every bucket in [first, last), flat[b.offset, +padded) = concatenation over ranks
// of their chunks. A bucket larger than max_elements (> 0) is gathered in pieces of at most
// max_elements elements through `staging` (at least max_elements elements of flat's dtype, or empty
// if no bucket needs it).
void bucketed_all_gather(Communicator& comm, const BucketPlan& plan, const Buffer& shard,
                         const Buffer& flat, int first, int last, int64_t max_elements,
                         const Buffer& staging, const CallOptions& opts);

// A handle on submitted work.
class Work {
 public:
  // Blocks until the work finished; rethrows its exception. Throws TimeoutError after timeout_s.
  // The exception is rethrown by the first wait() only; later ones throw a BackendError that says
  // so: an exception raised by a Python communicator (pybind11's error_already_set) can be
  // restored into Python once, and a second rethrow of it would terminate the process.
  void wait(double timeout_s);
  bool done();
  // Whether it finished with an error (a later queued work can then skip itself: see skip_after).
  bool failed();

 private:
  friend class AsyncComm;
  void finish(std::exception_ptr e);
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  bool reported_ = false;  // error_ was rethrown once
  std::exception_ptr error_;
};

// Runs submitted work on one worker thread, in submission order; inline in submit() instead when
// the communicator may only be called from one thread (Communicator::thread_restriction).
class AsyncComm {
 public:
  explicit AsyncComm(std::shared_ptr<Communicator> comm);
  ~AsyncComm();
  AsyncComm(const AsyncComm&) = delete;
  AsyncComm& operator=(const AsyncComm&) = delete;

  // Queues fn (run on the worker thread with the communicator); returns its handle.
  std::shared_ptr<Work> submit(std::function<void(Communicator&)> fn);
  // Waits for all queued work, then stops the thread. Idempotent.
  void close();
  Communicator& comm() { return *comm_; }
  int64_t pending();

 private:
  void loop();
  std::shared_ptr<Communicator> comm_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::function<void(Communicator&)>, std::shared_ptr<Work>>> queue_;
  int64_t running_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

// Throws (BackendError naming `call` and the rank) when `after` failed: for a work queued behind
// another of the same logical call (one bucket of several), so that an error every rank raised in
// `after` (ranks that disagree, a non-finite input) does not leave the later works' collectives
// waiting for peers that already gave up. AsyncComm runs in order, so `after` is done by then.
void skip_after(const std::shared_ptr<Work>& after, const Communicator& comm, const char* call);

}  // namespace compcomm::zero
