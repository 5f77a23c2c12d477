// compcomm._C.zero: bucket planning and (asynchronous) bucketed collectives for ZeRO. Exports only.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "call_keeping.h"
#include "../compressed_allreduce.h"
#include "../zero/bucket.h"

namespace py = pybind11;
using namespace compcomm;
using namespace compcomm::zero;

namespace {
CallOptions opts_of(double timeout_s, uintptr_t stream = 0) {
  COMPCOMM_CHECK(timeout_s > 0, "timeout must be positive, got ", timeout_s);
  return CallOptions{timeout_s, reinterpret_cast<void*>(stream)};
}
int last_of(const BucketPlan& p, int last) { return last < 0 ? static_cast<int>(p.buckets.size()) : last; }
}  // namespace

void bind_zero(py::module_& parent) {
  py::module_ m = parent.def_submodule("zero", "Bucket planning and bucketed collectives for ZeRO.");

  py::class_<BucketPlan>(m, "BucketPlan",
                         "Layout of tensors in a flat buffer cut into buckets; rank r owns chunk r of each "
                         "bucket (see plan_buckets).")
      .def_readonly("world", &BucketPlan::world)
      .def_readonly("alignment", &BucketPlan::alignment)
      .def_readonly("bucket_size", &BucketPlan::bucket_size)
      .def_readonly("flat_numel", &BucketPlan::flat_numel)
      .def_readonly("shard_numel", &BucketPlan::shard_numel)
      .def_property_readonly("num_buckets", [](const BucketPlan& p) { return p.buckets.size(); })
      .def_property_readonly("tensors",
                             [](const BucketPlan& p) {
                               py::list out;
                               for (const auto& t : p.tensors) out.append(py::make_tuple(t.numel, t.offset, t.bucket));
                               return out;
                             },
                             "List of (numel, offset in flat, bucket index) per tensor.")
      .def_property_readonly(
          "buckets",
          [](const BucketPlan& p) {
            py::list out;
            for (const auto& b : p.buckets) {
              py::dict d;
              d["offset"] = b.offset;
              d["numel"] = b.numel;
              d["padded"] = b.padded;
              d["chunk"] = b.chunk;
              d["shard_offset"] = b.shard_offset;
              d["first_tensor"] = b.first_tensor;
              d["last_tensor"] = b.last_tensor;
              out.append(d);
            }
            return out;
          },
          "One dict per bucket: offset, numel, padded, chunk, shard_offset, first_tensor, last_tensor.");

  m.def("plan_buckets", &plan_buckets, py::arg("sizes"), py::arg("bucket_size"), py::arg("world"),
        py::arg("alignment") = 1,
        "Flatten tensors of `sizes` elements into buckets of at most bucket_size elements (a larger tensor "
        "gets its own; bucket_size <= 0: one tensor per bucket), each padded to a multiple of "
        "world*alignment and split into world equal chunks.");

  m.def(
      "bucketed_reduce_scatter",
      [](Communicator& comm, const BucketPlan& plan, const Buffer& flat, const Buffer& shard, int first,
         int last, ReduceOp op, double timeout_s) {
        bucketed_reduce_scatter(comm, plan, flat, shard, first, last_of(plan, last), op, opts_of(timeout_s));
      },
      py::arg("comm"), py::arg("plan"), py::arg("flat"), py::arg("shard"), py::arg("first") = 0,
      py::arg("last") = -1, py::arg("op") = ReduceOp::kSum, py::arg("timeout_s") = 600.0,
      py::call_guard<py::gil_scoped_release>(), "Reduce-scatter buckets [first, last) of flat into shard.");

  m.def(
      "bucketed_all_gather",
      [](Communicator& comm, const BucketPlan& plan, const Buffer& shard, const Buffer& flat, int first,
         int last, int64_t max_elements, const Buffer& staging, double timeout_s) {
        bucketed_all_gather(comm, plan, shard, flat, first, last_of(plan, last), max_elements, staging,
                            opts_of(timeout_s));
      },
      py::arg("comm"), py::arg("plan"), py::arg("shard"), py::arg("flat"), py::arg("first") = 0,
      py::arg("last") = -1, py::arg("max_elements") = 0, py::arg("staging") = Buffer{},
      py::arg("timeout_s") = 600.0, py::call_guard<py::gil_scoped_release>(),
      "All-gather buckets [first, last) of every rank's shard into flat (pieces of <= max_elements).");

  py::class_<Work, std::shared_ptr<Work>>(m, "Work", "Handle on a collective submitted to an AsyncComm.")
      .def("wait", &Work::wait, py::arg("timeout_s") = 600.0, py::call_guard<py::gil_scoped_release>(),
           "Block until done (GIL released); re-raise its error; CommTimeoutError after timeout_s.")
      .def("done", &Work::done)
      .def("failed", &Work::failed, "Whether it finished with an error.");

  py::class_<AsyncComm, std::shared_ptr<AsyncComm>>(
      m, "AsyncComm",
      "One worker thread running collectives on a communicator in submission order (overlap_comm). "
      "Keep the buffers alive until the Work is waited on; do not use the communicator directly while "
      "work is pending. A communicator only one thread may call (MPI below MPI_THREAD_MULTIPLE) runs "
      "each work inside the submitting call instead (no overlap). `stream`: the CUDA stream the work is "
      "enqueued on (the caller's current one for device buffers; 0: the legacy default stream).")
      .def(py::init<std::shared_ptr<Communicator>>(), py::arg("comm"), py::keep_alive<1, 2>())
      .def_property_readonly("pending", &AsyncComm::pending)
      .def("close", &AsyncComm::close, py::call_guard<py::gil_scoped_release>())
      .def(
          "bucketed_reduce_scatter",
          [](AsyncComm& a, const BucketPlan& plan, const Buffer& flat, const Buffer& shard, int first, int last,
             ReduceOp op, double timeout_s, uintptr_t stream) {
            const int l = last_of(plan, last);
            const CallOptions o = opts_of(timeout_s, stream);
            return a.submit([plan, flat, shard, first, l, op, o](Communicator& c) {
              bucketed_reduce_scatter(c, plan, flat, shard, first, l, op, o);
            });
          },
          py::arg("plan"), py::arg("flat"), py::arg("shard"), py::arg("first") = 0, py::arg("last") = -1,
          py::arg("op") = ReduceOp::kSum, py::arg("timeout_s") = 600.0, py::arg("stream") = 0,
          py::call_guard<py::gil_scoped_release>())
      .def(
          "bucketed_all_gather",
          [](AsyncComm& a, const BucketPlan& plan, const Buffer& shard, const Buffer& flat, int first, int last,
             int64_t max_elements, const Buffer& staging, double timeout_s, uintptr_t stream) {
            const int l = last_of(plan, last);
            const CallOptions o = opts_of(timeout_s, stream);
            return a.submit([plan, shard, flat, first, l, max_elements, staging, o](Communicator& c) {
              bucketed_all_gather(c, plan, shard, flat, first, l, max_elements, staging, o);
            });
          },
          py::arg("plan"), py::arg("shard"), py::arg("flat"), py::arg("first") = 0, py::arg("last") = -1,
          py::arg("max_elements") = 0, py::arg("staging") = Buffer{}, py::arg("timeout_s") = 600.0,
          py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "reduce_scatter",
          [](AsyncComm& a, const Buffer& send, const Buffer& recv, ReduceOp op, double timeout_s,
             uintptr_t stream) {
            const CallOptions o = opts_of(timeout_s, stream);
            return a.submit([send, recv, op, o](Communicator& c) { c.reduce_scatter(send, recv, op, o); });
          },
          py::arg("send"), py::arg("recv"), py::arg("op") = ReduceOp::kSum, py::arg("timeout_s") = 600.0,
          py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "all_gather",
          [](AsyncComm& a, const Buffer& send, const Buffer& recv, double timeout_s, uintptr_t stream) {
            const CallOptions o = opts_of(timeout_s, stream);
            return a.submit([send, recv, o](Communicator& c) { c.all_gather(send, recv, o); });
          },
          py::arg("send"), py::arg("recv"), py::arg("timeout_s") = 600.0, py::arg("stream") = 0,
          py::call_guard<py::gil_scoped_release>())
      .def(
          "all_reduce",
          [](AsyncComm& a, const Buffer& buf, ReduceOp op, double timeout_s, uintptr_t stream) {
            const CallOptions o = opts_of(timeout_s, stream);
            return a.submit([buf, op, o](Communicator& c) { c.all_reduce(buf, op, o); });
          },
          py::arg("buf"), py::arg("op") = ReduceOp::kSum, py::arg("timeout_s") = 600.0, py::arg("stream") = 0,
          py::call_guard<py::gil_scoped_release>())
      .def(
          "compressed_reduce_scatter_exchange",
          [](AsyncComm& a, const Buffer& tensor, const Buffer& worker_error, const Buffer& server_error,
             const Buffer& out, const Buffer& workspace, double timeout_s, std::shared_ptr<Work> after,
             uintptr_t stream) {
            const CallOptions o = opts_of(timeout_s, stream);
            return a.submit([tensor, worker_error, server_error, out, workspace, o, after](Communicator& c) {
              skip_after(after, c, "compressed_reduce_scatter_exchange");
              compressed_reduce_scatter_exchange(c, tensor, worker_error, server_error, out, workspace, o);
            });
          },
          py::arg("tensor"), py::arg("worker_error"), py::arg("server_error"), py::arg("out"),
          py::arg("workspace"), py::arg("timeout_s") = 600.0, py::arg("after") = std::shared_ptr<Work>(),
          py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
          "Queue the exchange half of a compressed reduce-scatter. With `after` (an earlier Work of the "
          "same call), it raises instead of communicating if `after` failed.")
      .def(
          "compressed_allreduce_exchange",
          [](AsyncComm& a, const Buffer& tensor, const Buffer& worker_error, const Buffer& server_error,
             const Buffer& workspace, double timeout_s, uintptr_t stream, std::shared_ptr<Work> after) {
            const CallOptions o = opts_of(timeout_s, stream);
            return a.submit([tensor, worker_error, server_error, workspace, o, after](Communicator& c) {
              skip_after(after, c, "compressed_allreduce_exchange");
              compressed_allreduce_exchange(c, tensor, worker_error, server_error, workspace, o);
            });
          },
          py::arg("tensor"), py::arg("worker_error"), py::arg("server_error"), py::arg("workspace"),
          py::arg("timeout_s") = 600.0, py::arg("stream") = 0, py::arg("after") = std::shared_ptr<Work>(),
          py::call_guard<py::gil_scoped_release>(),
          "Queue the exchange half of a compressed allreduce (all collectives and checks; writes only the "
          "workspace); compressed_allreduce_commit does the local writes. With `after` (the Work of an "
          "earlier bucket of the same call) it raises instead of communicating if `after` failed: an error "
          "every rank raised there leaves no later collective waiting for peers.")
      .def(
          "compressed_allreduce_exchange_many",
          [](AsyncComm& a, const std::vector<Buffer>& tensors, const std::vector<Buffer>& worker_errors,
             const std::vector<Buffer>& server_errors, const std::vector<Buffer>& workspaces,
             const Buffer& staging, double timeout_s, uintptr_t stream) {
            const CallOptions o = opts_of(timeout_s, stream);
            return a.submit([tensors, worker_errors, server_errors, workspaces, staging, o](Communicator& c) {
              compressed_allreduce_exchange_many(c, tensors, worker_errors, server_errors, workspaces, staging, o);
            });
          },
          py::arg("tensors"), py::arg("worker_errors"), py::arg("server_errors"), py::arg("workspaces"),
          py::arg("staging"), py::arg("timeout_s") = 600.0, py::arg("stream") = 0,
          py::call_guard<py::gil_scoped_release>(),
          "Queue the exchange halves of several compressed allreduces as three collectives in all "
          "(compressed_allreduce_exchange_many); each is then committed with compressed_allreduce_commit.");

  m.def(
      "compressed_reduce_scatter",
      [](Communicator& comm, const Buffer& tensor, const Buffer& worker_error, const Buffer& server_error,
         const Buffer& out, const Buffer& workspace, double timeout_s, uintptr_t stream) {
        call_keeping(comm, {&tensor, &worker_error, &server_error, &out, &workspace}, [&] {
          compressed_reduce_scatter(comm, tensor, worker_error, server_error, out, workspace,
                                    opts_of(timeout_s, stream));
        });
      },
      py::arg("comm"), py::arg("tensor"), py::arg("worker_error"), py::arg("server_error"), py::arg("out"),
      py::arg("workspace"), py::arg("timeout_s") = 600.0, py::arg("stream") = 0,
      "The 1-bit compressed reduce-scatter (compressed allreduce without its final all-gather).");
  m.def(
      "compressed_reduce_scatter_commit",
      [](Communicator& comm, const Buffer& tensor, const Buffer& worker_error, const Buffer& server_error,
         const Buffer& out, const Buffer& workspace, bool gate, uintptr_t stream) {
        CallOptions opts;
        opts.gate = gate;
        opts.stream = reinterpret_cast<void*>(stream);
        compressed_reduce_scatter_commit(comm, tensor, worker_error, server_error, out, workspace, opts);
      },
      py::arg("comm"), py::arg("tensor"), py::arg("worker_error"), py::arg("server_error"), py::arg("out"),
      py::arg("workspace"), py::arg("gate") = true, py::arg("stream") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "The local writes of a compressed reduce-scatter whose exchange (AsyncComm."
      "compressed_reduce_scatter_exchange or compressed_reduce_scatter_exchange_many) ran on the same "
      "arguments and workspace; on `stream` (a CUDA stream handle, 0: the default stream).");
  m.def(
      "compressed_allreduce_commit",
      [](Communicator& comm, const Buffer& tensor, const Buffer& worker_error, const Buffer& server_error,
         const Buffer& workspace, uintptr_t stream, bool gate) {
        CallOptions opts = opts_of(600.0, stream);
        opts.gate = gate;
        compressed_allreduce_commit(comm, tensor, worker_error, server_error, workspace, opts);
      },
      py::arg("comm"), py::arg("tensor"), py::arg("worker_error"), py::arg("server_error"), py::arg("workspace"),
      py::arg("stream") = 0, py::arg("gate") = true, py::call_guard<py::gil_scoped_release>(),
      "The local writes of a compressed allreduce whose exchange (AsyncComm.compressed_allreduce_exchange) "
      "ran on the same arguments and workspace.");
  m.def(
      "compressed_allreduce_commit_many",
      [](Communicator& comm, const std::vector<Buffer>& tensors,
         const std::vector<Buffer>& worker_errors, const std::vector<Buffer>& server_errors,
         const std::vector<Buffer>& workspaces, uintptr_t stream, bool gate) {
        const size_t calls = tensors.size();
        if (worker_errors.size() != calls || server_errors.size() != calls ||
            workspaces.size() != calls)
          throw py::value_error(detail::concat(
              "compressed_allreduce_commit_many: tensors, worker_errors, server_errors and "
              "workspaces must have the same length (",
              calls, ", ", worker_errors.size(), ", ", server_errors.size(), ", ",
              workspaces.size(), ")"));
        CallOptions opts = opts_of(600.0, stream);
        opts.gate = gate;
        compressed_allreduce_commit_many(comm, tensors, worker_errors, server_errors, workspaces, opts);
      },
      py::arg("comm"), py::arg("tensors"), py::arg("worker_errors"), py::arg("server_errors"),
      py::arg("workspaces"), py::arg("stream") = 0, py::arg("gate") = true,
      py::call_guard<py::gil_scoped_release>(),
      "compressed_allreduce_commit of every call of one exchange, bit for bit (one crossing into "
      "C++ and, on a GPU, O(1) kernel launches for all buckets); every argument is validated first.");
  m.def(
      "compressed_allreduce_exchange_many",
      [](Communicator& comm, const std::vector<Buffer>& tensors, const std::vector<Buffer>& worker_errors,
         const std::vector<Buffer>& server_errors, const std::vector<Buffer>& workspaces, const Buffer& staging,
         double timeout_s, uintptr_t stream) {
        call_keeping(comm, {&staging}, [&] {  // the batched collectives run on staging
          compressed_allreduce_exchange_many(comm, tensors, worker_errors, server_errors, workspaces, staging,
                                             opts_of(timeout_s, stream));
        });
      },
      py::arg("comm"), py::arg("tensors"), py::arg("worker_errors"), py::arg("server_errors"),
      py::arg("workspaces"), py::arg("staging"), py::arg("timeout_s") = 600.0, py::arg("stream") = 0,
      "The exchange halves of several compressed allreduces in three collectives (headers, signs, records "
      "of every call batched); commit each with compressed_allreduce_commit.");
  m.def(
      "compressed_reduce_scatter_exchange_many",
      [](Communicator& comm, const std::vector<Buffer>& tensors, const std::vector<Buffer>& worker_errors,
         const std::vector<Buffer>& server_errors, const std::vector<Buffer>& outs,
         const std::vector<Buffer>& workspaces, const Buffer& staging, double timeout_s, uintptr_t stream) {
        call_keeping(comm, {&staging}, [&] {  // the batched collectives run on staging
          compressed_reduce_scatter_exchange_many(comm, tensors, worker_errors, server_errors, outs, workspaces,
                                                  staging, opts_of(timeout_s, stream));
        });
      },
      py::arg("comm"), py::arg("tensors"), py::arg("worker_errors"), py::arg("server_errors"), py::arg("outs"),
      py::arg("workspaces"), py::arg("staging"), py::arg("timeout_s") = 600.0, py::arg("stream") = 0,
      "The exchange halves of several compressed reduce-scatters in three collectives (call counts, "
      "headers, signs); commit each with compressed_reduce_scatter_commit.");
  m.def(
      "compressed_allreduce_batch_bytes",
      [](const std::vector<int64_t>& paddeds, int world) { return compressed_allreduce_batch_bytes(paddeds, world); },
      py::arg("paddeds"), py::arg("world"),
      "Staging bytes compressed_allreduce_exchange_many needs for calls of these padded sizes.");
  m.def(
      "compressed_reduce_scatter_wire_bytes",
      [](int64_t padded, int world) {
        return compressed_reduce_scatter_wire_bytes(padded, world);
      },
      py::arg("padded"), py::arg("world"), "Bytes one rank sends in one compressed_reduce_scatter call.");
}
