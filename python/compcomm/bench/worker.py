"""One benchmark rank: ``python -m compcomm.bench.worker --config FILE``.

Started by :mod:`compcomm.bench.runner` once per rank (inside the rank's network namespace for the
namespace profiles) with ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and
``GLOO_SOCKET_IFNAME`` in its environment. It joins a gloo group and, for every size and method,
follows nccl-tests: the first call is checked (#wrong), rank 0 times one more call, decides how many
iterations fill the time budget and broadcasts that count, then all ranks run them back to back in
up to 5 timed batches; ``time_s`` is the median over batches of the slowest rank's mean time per
call (``time_mean_s``: the plain mean over all calls, nccl-tests' figure). Rank 0 prints one ``ROW {json}`` line per measurement and
``PROGRESS`` lines; everything else goes to stderr.

Methods
-------
compressed
    :func:`compcomm.compressed_allreduce` on fp32 through the torch adapter (gloo underneath).
gloo_fp32, gloo_fp16
    ``torch.distributed.all_reduce`` (sum) of fp32 / fp16 tensors.
mpi_compressed, mpi_fp32 (opt-in: the ranks must be started by mpirun, see ``run_sweep``)
    The compressed allreduce, and a plain fp32 allreduce (sum), through compcomm's MPI
    communicator (``compcomm.make_communicator("mpi")``); on namespace profiles MPI's traffic is
    TCP over the same shaped links.
compute (always measured alongside ``compressed``)
    The same compressed allreduce of ``W`` ranks with the network replaced by local copies
    (:class:`MirrorCommunicator`), run on every rank at once so that the CPU sharing matches the real
    run: the compression compute the cost model uses.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import sys
import time
import zlib
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

import compcomm

METHODS = ("compressed", "gloo_fp32", "gloo_fp16")  # the default set
MPI_METHODS = ("mpi_compressed", "mpi_fp32")
ALL_METHODS = METHODS + MPI_METHODS
@functools.lru_cache(maxsize=None)
def mpi_communicator() -> compcomm.Communicator:
    """Collective on first use (every rank reaches its first MPI method together): compcomm's
    MPI communicator of this mpirun job, made once."""
    mpi = compcomm.make_communicator("mpi", cuda_aware=False)
    if mpi.size() != dist.get_world_size():
        raise RuntimeError(f"worker: the MPI world has {mpi.size()} ranks, the gloo world "
                           f"{dist.get_world_size()}; start the ranks with one mpirun")
    return mpi


def plain_input(n: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers (exact in fp16 and fp32 for any sum of <= 64 ranks), different per rank."""
    i = torch.arange(n, dtype=torch.int64)
    return ((i * 7 + rank * 13) % 17 - 8).to(dtype)


def plain_expected(n: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    """The exact elementwise sum of every rank's :func:`plain_input`."""
    tot = torch.zeros(n, dtype=torch.int64)
    for r in range(world):
        tot += plain_input(n, r, torch.int64)
    return tot.to(dtype)


def compressed_input(n: int, rank: int) -> torch.Tensor:
    """Deterministic non-integer fp32 values in [-0.5, 0.5), different per rank, cheap to remake."""
    i = torch.arange(n, dtype=torch.int64)
    return (((i * 7919 + rank * 104729 + 17) % 1000003).to(torch.float64) / 1000003 - 0.5).to(
        torch.float32
    )


def compressed_reference(n: int, world: int) -> torch.Tensor:
    """Output of the first compressed allreduce (zero errors) per ONEBIT_SPEC.md a.2, float64 norms."""
    p = compcomm.padded_numel(n, world)
    c_len = p // world
    inv_w = torch.tensor(1.0 / world, dtype=torch.float32)
    sqrt_p = torch.tensor(math.sqrt(p), dtype=torch.float32)
    acc = torch.zeros(p, dtype=torch.float32)
    for r in range(world):
        x = torch.zeros(p, dtype=torch.float32)
        x[:n] = compressed_input(n, r)
        sigma = (torch.linalg.vector_norm(x.double()) / sqrt_p.double()).float()
        s = torch.where(x < 0, -1.0, 1.0)
        acc += s * (sigma * inv_w)
    out = torch.empty(p, dtype=torch.float32)
    sqrt_c = torch.tensor(math.sqrt(c_len), dtype=torch.float32)
    for j in range(world):
        c = acc[j * c_len : (j + 1) * c_len]
        tau = (torch.linalg.vector_norm(c.double()) / sqrt_c.double()).float()
        out[j * c_len : (j + 1) * c_len] = torch.where(c < 0, -1.0, 1.0) * tau
    return out[:n]


class MirrorCommunicator(compcomm.Communicator):
    """A rank of a ``size``-rank world whose peers all send exactly what this rank sends.

    Collectives become local copies, so a compressed allreduce through it does all the compute of a
    real ``size``-rank call (same chunk sizes, same kernels) and moves no data over any network.
    """

    def __init__(self, rank: int, size: int) -> None:
        compcomm.Communicator.__init__(self)
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def backend_name(self) -> str:
        return "mirror"

    def do_all_to_all(self, send, recv, opts) -> None:  # type: ignore[no-untyped-def]
        s = memoryview(send).cast("B")
        r = memoryview(recv).cast("B")
        row = len(s) // self._size
        mine = s[self._rank * row : (self._rank + 1) * row]
        for i in range(self._size):
            r[i * row : (i + 1) * row] = mine

    def do_all_gather(self, send, recv, opts) -> None:  # type: ignore[no-untyped-def]
        s = memoryview(send).cast("B")
        r = memoryview(recv).cast("B")
        for i in range(self._size):
            r[i * len(s) : (i + 1) * len(s)] = s

    def do_reduce_scatter(self, send, recv, op, opts) -> None:  # type: ignore[no-untyped-def]
        raise NotImplementedError("MirrorCommunicator: reduce_scatter is not used by the benchmark")

    def do_all_reduce(self, buf, op, opts) -> None:  # type: ignore[no-untyped-def]
        raise NotImplementedError("MirrorCommunicator: all_reduce is not used by the benchmark")

    def do_broadcast(self, buf, root, opts) -> None:  # type: ignore[no-untyped-def]
        pass

    def do_barrier(self, opts) -> None:  # type: ignore[no-untyped-def]
        pass


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy()) & 0x7FFFFFFF


def _time_loop(op: Callable[[], None], iters: int) -> float:
    """Barrier, run ``op`` ``iters`` times, return the slowest rank's mean seconds per call."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        op()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt.item()) / iters


def _time_batches(op: Callable[[], None], iters: int, batches: int) -> Tuple[float, float, List[float]]:
    """``iters`` calls in ``batches`` timed batches (barrier before each, slowest rank each).

    Returns the median and the mean of the batch means and the batch means: on a shared machine a
    load spike spoils one batch, and the median ignores it where nccl-tests' plain mean would not.
    """
    batches = max(1, min(batches, iters))
    per = [iters // batches + (1 if b < iters % batches else 0) for b in range(batches)]
    means = [_time_loop(op, k) for k in per]
    total = sum(m * k for m, k in zip(means, per)) / iters
    return float(sorted(means)[len(means) // 2]), total, means


def _decide_iters(op: Callable[[], None], cfg: Dict[str, Any]) -> int:
    """Rank 0 times one call and broadcasts how many calls fill ``target_time`` (nccl-tests style)."""
    one = _time_loop(op, 1)
    n = torch.tensor([0], dtype=torch.int64)
    if dist.get_rank() == 0:
        want = int(math.ceil(cfg["target_time"] / max(one, 1e-6)))
        n[0] = max(cfg["min_iters"], min(cfg["max_iters"], want))
    dist.broadcast(n, 0)
    return int(n.item())


def prepare(method: str, n: int) -> Dict[str, Any]:
    """Collective on all ranks: build ``method``'s inputs for ``n`` elements, run and check the first
    call (nccl-tests' correctness pass), and return the timed operation.

    Returns
    -------
    dict
        ``op`` (callable, one call), ``wrong`` (elements wrong in the first call, same on all ranks),
        ``size_bytes`` (logical), ``wire_bytes`` (sent per rank per call), ``dtype``, and for
        ``compressed`` ``compute_op`` (the call with the network replaced by copies).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if method in ("compressed", "mpi_compressed"):
        comm = mpi_communicator() if method == "mpi_compressed" else None  # None: the gloo world
        t = compressed_input(n, rank)
        we, se = compcomm.error_buffers(t, comm)
        compcomm.compressed_allreduce(t, we, se, comm)
        # Every rank's output must be bit-identical; rank 0 compares it with the reference.
        crcs: List[Any] = [None] * world
        dist.all_gather_object(crcs, _crc(t))
        wrong = n * sum(1 for c in crcs if c != crcs[0])
        if rank == 0:
            ref = compressed_reference(n, world)
            tol = 1e-5 * float(ref.abs().max().item()) if n else 0.0
            wrong += int(((t - ref).abs() > tol).sum().item())
        w = torch.tensor([wrong], dtype=torch.int64)
        dist.broadcast(w, 0)
        prep = {
            "op": lambda: compcomm.compressed_allreduce(t, we, se, comm),
            "wrong": int(w.item()),
            "size_bytes": n * 4,
            "wire_bytes": compcomm.wire_bytes(n, world),
            "dtype": "float32",
        }
        if comm is None:
            # The compute-only replay reuses the timed call's buffers: compute does not depend on
            # the values, memory use does.
            mirror = MirrorCommunicator(rank, world)
            prep["compute_op"] = lambda: compcomm.compressed_allreduce(t, we, se, mirror)
        return prep
    if method not in ("gloo_fp32", "gloo_fp16", "mpi_fp32"):
        raise ValueError(f"worker: unknown method {method!r}; choose from {', '.join(ALL_METHODS)}")
    dtype = torch.float16 if method == "gloo_fp16" else torch.float32
    t = plain_input(n, rank, dtype)
    if method == "mpi_fp32":
        from .._buffers import buffer_of

        mpi, buf = mpi_communicator(), buffer_of(t)

        def all_reduce() -> None:
            mpi.all_reduce(buf)
    else:

        def all_reduce() -> None:
            dist.all_reduce(t)

    all_reduce()
    wrong_t = torch.tensor(
        [int((t != plain_expected(n, world, dtype)).sum().item())], dtype=torch.int64
    )
    dist.all_reduce(wrong_t)
    t.copy_(
        plain_input(n, rank, dtype)
    )  # values grow W-fold per call; timing does not depend on them
    esize = t.element_size()
    return {
        "op": all_reduce,
        "wrong": int(wrong_t.item()),
        "size_bytes": n * esize,
        "wire_bytes": compcomm.allreduce_wire_bytes(n, world, esize),
        "dtype": str(dtype).replace("torch.", ""),
    }


def measure(method: str, n: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Collective: one row for ``method`` at ``n`` elements (checked first call, rank 0's iteration
    count, slowest rank's mean time; for ``compressed`` also ``compute_s``)."""
    prep = prepare(method, n)
    iters = _decide_iters(prep["op"], cfg)
    nb = cfg.get("batches", 5)
    sec, mean, means = _time_batches(prep["op"], iters, nb)
    row = {k: prep[k] for k in ("wrong", "size_bytes", "wire_bytes", "dtype")}
    row.update(time_s=sec, time_mean_s=mean, batch_means_s=means, iters=iters)
    if "compute_op" in prep:
        prep["compute_op"]()
        citers = max(min(3, iters), min(iters, int(math.ceil(cfg["target_time"] / 2 / max(sec, 1e-6)))))
        row["compute_s"] = _time_batches(prep["compute_op"], citers, nb)[0]
    return row


#: Commands of the follower protocol (bench/bench_allreduce.py drives rank 0 from pytest).
_CMD_STOP, _CMD_RUN = 0, 1


def drive(method: str, n: int) -> Dict[str, Any]:
    """Rank 0 of a follower world: tell the followers to :func:`prepare` ``method`` at ``n``."""
    cmd = torch.tensor([_CMD_RUN, ALL_METHODS.index(method), n], dtype=torch.int64)
    dist.broadcast(cmd, 0)
    return prepare(method, n)


def drive_rounds(rounds: int) -> None:
    """Rank 0 of a follower world: tell the followers to run the prepared op ``rounds`` times
    (``0``: this op is done)."""
    dist.broadcast(torch.tensor([rounds], dtype=torch.int64), 0)


def stop_followers() -> None:
    """Rank 0 of a follower world: release the followers (they leave through a final barrier)."""
    dist.broadcast(torch.tensor([_CMD_STOP, 0, 0], dtype=torch.int64), 0)
    dist.barrier()


def follow() -> None:
    """Ranks > 0 of a follower world: obey rank 0's commands until it sends stop.

    Protocol: ``[RUN, method index, n]`` -> :func:`prepare`; then ``[rounds]`` messages -> run the op
    that many times (rank 0 runs it as often, under pytest-benchmark's timer) until ``[0]``; repeat.
    """
    while True:
        cmd = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(cmd, 0)
        if int(cmd[0]) == _CMD_STOP:
            return
        prep = prepare(ALL_METHODS[int(cmd[1])], int(cmd[2]))
        while True:
            rounds = torch.zeros(1, dtype=torch.int64)
            dist.broadcast(rounds, 0)
            if int(rounds[0]) == 0:
                break
            for _ in range(int(rounds[0])):
                prep["op"]()


def main(argv: List[str] = None) -> int:
    """Entry point of one rank; see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="JSON file written by compcomm.bench.runner")
    ap.add_argument("--follow", action="store_true", help="obey rank 0's commands (pytest driver)")
    args = ap.parse_args(argv)
    cfg: Dict[str, Any] = {}
    if args.config:
        with open(args.config) as f:
            cfg = json.load(f)
    elif not args.follow:
        ap.error("argument --config is required (unless --follow)")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.get("timeout", 600)))
    torch.set_num_threads(1)  # one core per rank
    rank, world = dist.get_rank(), dist.get_world_size()
    out = sys.stdout
    if args.follow:
        follow()
    else:
        for n in cfg["sizes"]:
            for method in cfg["methods"]:
                row = measure(method, n, cfg)
                if rank == 0:
                    row.update(
                        method=method, count=n, world_size=world, profile=cfg.get("profile", "?")
                    )
                    print("ROW " + json.dumps(row), file=out, flush=True)
    # Ranks leave together, then skip interpreter teardown: destroying the gloo group while a peer
    # is still closing its sockets aborted a rank now and then ("terminate called without an active
    # exception") after all results were in.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)
