"""pytest-benchmark: compcomm compressed allreduce vs gloo allreduce on the loopback profile.

Skipped by default (``--benchmark-skip`` in addopts). Run::

    python -m pytest bench/bench_allreduce.py --benchmark-only --benchmark-enable \\
        --benchmark-json bench/results/pytest-benchmark.json

The pytest process is rank 0 of a gloo world on 127.0.0.1; ranks 1..W-1 are
``python -m compcomm.bench.worker --follow`` processes that run each operation as often as rank 0
does (nccl-tests' rule: rank 0 decides the count). Every benchmark's first call is checked
(``extra_info['wrong']``), and ``extra_info['speedup_vs_gloo_fp32']`` is the ratio against the
plain fp32 allreduce measured earlier in the same session. World size: ``COMPCOMM_BENCH_WORLD``
(default 2); sizes: ``COMPCOMM_BENCH_SIZES`` (default ``2^16,2^20,2^24``).
"""

from __future__ import annotations

import datetime
import math
import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("pytest_benchmark")

from compcomm.bench import worker  # noqa: E402
from compcomm.bench.cli import parse_sizes  # noqa: E402
from compcomm.testing import free_port  # noqa: E402

WORLD = int(os.environ.get("COMPCOMM_BENCH_WORLD", "2"))
SIZES = parse_sizes(os.environ.get("COMPCOMM_BENCH_SIZES", "2^16,2^20,2^24"))
TARGET_S = float(os.environ.get("COMPCOMM_BENCH_TARGET", "1.0"))
_plain_mean: dict = {}


@pytest.fixture(scope="module")
def world():
    """Rank 0 (this process) of a gloo world whose other ranks follow its commands."""
    if dist.is_initialized():
        pytest.skip("a torch.distributed group already exists in this process")
    port = free_port()
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(WORLD),
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "compcomm.bench.worker", "--follow"], env=dict(env, RANK=str(r))
        )
        for r in range(1, WORLD)
    ]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    try:
        dist.init_process_group(
            "gloo", rank=0, world_size=WORLD, timeout=datetime.timedelta(seconds=300)
        )
        yield WORLD
        worker.stop_followers()
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize(
    "n", SIZES, ids=[f"n=2^{int(math.log2(n))}" if n & (n - 1) == 0 else f"n={n}" for n in SIZES]
)
@pytest.mark.parametrize("method", ["gloo_fp32", "gloo_fp16", "compressed"])
def test_allreduce(benchmark, world, method, n):
    prep = worker.drive(method, n)  # followers prepare too; the first call is checked here
    worker.drive_rounds(1)  # one call, timed here, decides the round count
    t0 = time.perf_counter()
    prep["op"]()
    one = time.perf_counter() - t0
    rounds = max(3, min(500, int(math.ceil(TARGET_S / max(one, 1e-6)))))
    worker.drive_rounds(rounds + 1)  # followers: rounds + one warm-up
    benchmark.pedantic(prep["op"], rounds=rounds, iterations=1, warmup_rounds=1)
    worker.drive_rounds(0)
    mean = benchmark.stats.stats.mean
    benchmark.extra_info.update(
        world_size=world,
        count=n,
        dtype=prep["dtype"],
        size_bytes=prep["size_bytes"],
        wire_bytes=prep["wire_bytes"],
        wrong=prep["wrong"],
        profile="loopback",
        algbw_GBps=prep["size_bytes"] / mean / 1e9,
        busbw_GBps=prep["size_bytes"] / mean / 1e9 * 2 * (world - 1) / world,
    )
    if method == "gloo_fp32":
        _plain_mean[n] = mean
    elif n in _plain_mean:
        benchmark.extra_info["speedup_vs_gloo_fp32"] = _plain_mean[n] / mean
    assert prep["wrong"] == 0, (
        f"{method} n={n}: {prep['wrong']} wrong elements in the checked first call"
    )
