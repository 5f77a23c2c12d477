#include "bucket.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "../kernels/kernels.h"

namespace compcomm::zero {

BucketPlan plan_buckets(const std::vector<int64_t>& sizes, int64_t bucket_size, int world,
                        int64_t alignment) {
  COMPCOMM_CHECK(world >= 1, "plan_buckets: world must be >= 1, got ", world);
  COMPCOMM_CHECK(alignment >= 1, "plan_buckets: alignment must be >= 1, got ", alignment);
  BucketPlan plan;
  plan.world = world;
  plan.alignment = alignment;
  plan.bucket_size = bucket_size;
  const int64_t unit = static_cast<int64_t>(world) * alignment;
  int64_t flat = 0, shard = 0;
  auto close_bucket = [&](BucketSlot& b) {
    b.padded = (b.numel + unit - 1) / unit * unit;
    if (b.padded == 0) b.padded = unit;  // an empty tensor still owns a (padding-only) chunk
    b.chunk = b.padded / world;
    b.shard_offset = shard;
    flat += b.padded;
    shard += b.chunk;
    plan.buckets.push_back(b);
  };
  BucketSlot cur{0, 0, 0, 0, 0, 0, 0};
  bool open = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t n = sizes[i];
    COMPCOMM_CHECK(n >= 0, "plan_buckets: sizes[", i, "] is negative (", n, ")");
    if (open && (bucket_size <= 0 || cur.numel + n > bucket_size)) {
      close_bucket(cur);
      open = false;
    }
    if (!open) {
      cur = BucketSlot{flat, 0, 0, 0, 0, static_cast<int>(i), static_cast<int>(i)};
      open = true;
    }
    plan.tensors.push_back(TensorSlot{n, cur.offset + cur.numel, static_cast<int>(plan.buckets.size())});
    cur.numel += n;
    cur.last_tensor = static_cast<int>(i) + 1;
  }
  if (open) close_bucket(cur);
  plan.flat_numel = flat;
  plan.shard_numel = shard;
  return plan;
}

namespace {
void check_range(const BucketPlan& plan, int first, int last, const char* call) {
  COMPCOMM_CHECK(0 <= first && first <= last && last <= static_cast<int>(plan.buckets.size()), call,
                 ": bucket range [", first, ", ", last, ") is outside [0, ", plan.buckets.size(), ")");
}
}  // namespace

void bucketed_reduce_scatter(Communicator& comm, const BucketPlan& plan, const Buffer& flat,
                             const Buffer& shard, int first, int last, ReduceOp op,
                             const CallOptions& opts) {
  check_range(plan, first, last, "bucketed_reduce_scatter");
  COMPCOMM_CHECK(comm.size() == plan.world, "bucketed_reduce_scatter: the plan is for world ", plan.world,
                 " but the communicator has ", comm.size(), " ranks");
  COMPCOMM_CHECK(flat.count >= plan.flat_numel && shard.count >= plan.shard_numel && flat.dtype == shard.dtype,
                 "bucketed_reduce_scatter: flat needs ", plan.flat_numel, " and shard ", plan.shard_numel,
                 " elements of one dtype (got ", flat.count, " ", dtype_name(flat.dtype), " and ",
                 shard.count, " ", dtype_name(shard.dtype), ")");
  for (int b = first; b < last; ++b) {
    const BucketSlot& s = plan.buckets[b];
    comm.reduce_scatter(flat.slice(s.offset, s.padded), shard.slice(s.shard_offset, s.chunk), op, opts);
  }
}

void bucketed_all_gather(Communicator& comm, const BucketPlan& plan, const Buffer& shard,
                         const Buffer& flat, int first, int last, int64_t max_elements,
                         const Buffer& staging, const CallOptions& opts) {
  check_range(plan, first, last, "bucketed_all_gather");
  COMPCOMM_CHECK(comm.size() == plan.world, "bucketed_all_gather: the plan is for world ", plan.world,
                 " but the communicator has ", comm.size(), " ranks");
  COMPCOMM_CHECK(flat.count >= plan.flat_numel && shard.count >= plan.shard_numel && flat.dtype == shard.dtype,
                 "bucketed_all_gather: flat needs ", plan.flat_numel, " and shard ", plan.shard_numel,
                 " elements of one dtype");
  const int world = plan.world;
  const size_t item = dtype_size(flat.dtype);
  for (int b = first; b < last; ++b) {
    const BucketSlot& s = plan.buckets[b];
    if (max_elements <= 0 || s.padded <= max_elements) {
      comm.all_gather(shard.slice(s.shard_offset, s.chunk), flat.slice(s.offset, s.padded), opts);
      continue;
    }
    // Too big for one call: gather pieces of every rank's chunk, then scatter them into place.
    const int64_t piece = std::max<int64_t>(1, max_elements / world);
    COMPCOMM_CHECK(staging.count >= piece * world && staging.dtype == flat.dtype && flat.on_host(),
                   "bucketed_all_gather: bucket ", b, " (", s.padded, " elements) exceeds max_elements=",
                   max_elements, " and needs a host staging buffer of ", piece * world, " elements");
    for (int64_t at = 0; at < s.chunk; at += piece) {
      const int64_t n = std::min(piece, s.chunk - at);
      comm.all_gather(shard.slice(s.shard_offset + at, n), staging.slice(0, n * world), opts);
      for (int r = 0; r < world; ++r)
        std::memcpy(flat.slice(s.offset + r * s.chunk + at, n).data, staging.slice(r * n, n).data,
                    static_cast<size_t>(n) * item);
    }
  }
}

void Work::finish(std::exception_ptr e) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    done_ = true;
    error_ = e;
  }
  cv_.notify_all();
}

bool Work::done() {
  std::lock_guard<std::mutex> lk(mu_);
  return done_;
}

bool Work::failed() {
  std::lock_guard<std::mutex> lk(mu_);
  return done_ && error_ != nullptr;
}

void skip_after(const std::shared_ptr<Work>& after, const Communicator& comm, const char* call) {
  if (after == nullptr || !after->failed()) return;
  throw BackendError(detail::concat("[rank ", comm.rank(), "] ", call, ": skipped, the exchange queued "
                                    "before it failed (that error is raised by its wait)"),
                     call, "", 0, comm.rank());
}

void Work::wait(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6));
  if (!cv_.wait_until(lk, deadline, [&] { return done_; }))
    throw TimeoutError(detail::concat("zero: asynchronous collective did not finish within ", timeout_s, " s"),
                       "Work.wait", "", 0, -1);
  if (!error_) return;
  if (reported_)
    throw BackendError("zero: this asynchronous collective failed; its error was raised by an earlier wait()",
                       "Work.wait", "", 0, -1);
  reported_ = true;
  std::rethrow_exception(error_);
}

AsyncComm::AsyncComm(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)) {
  COMPCOMM_CHECK(comm_ != nullptr, "AsyncComm: comm must not be None");
  // A communicator that only the calling thread may use (MPI below MPI_THREAD_MULTIPLE) runs each
  // work inside submit(): correct, without overlap.
  if (comm_->thread_restriction().empty()) thread_ = std::thread([this] { loop(); });
}

AsyncComm::~AsyncComm() { close(); }

std::shared_ptr<Work> AsyncComm::submit(std::function<void(Communicator&)> fn) {
  auto w = std::make_shared<Work>();
  if (!thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      COMPCOMM_CHECK(!stop_, "AsyncComm: submit after close()");
    }
    std::exception_ptr err;
    try {
      fn(*comm_);
    } catch (...) {
      err = std::current_exception();
    }
    w->finish(err);
    return w;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    COMPCOMM_CHECK(!stop_, "AsyncComm: submit after close()");
    queue_.emplace_back(std::move(fn), w);
  }
  cv_.notify_all();
  return w;
}

int64_t AsyncComm::pending() {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int64_t>(queue_.size()) + running_;
}

void AsyncComm::close() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void AsyncComm::loop() {
  for (;;) {
    std::pair<std::function<void(Communicator&)>, std::shared_ptr<Work>> item;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      item = std::move(queue_.front());
      queue_.pop_front();
      running_ = 1;
    }
    std::exception_ptr err;
    try {
      item.first(*comm_);
    } catch (...) {
      err = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      running_ = 0;
    }
    item.second->finish(err);
  }
}

}  // namespace compcomm::zero
