"""The CPU worker-side kernels of one compressed allreduce against memory-bound torch passes over
the same arrays, one thread, same run: how far the kernels are from this machine's memory floor.

pass 1 (worker_scale_pack) reads m and e (8 bytes per element); pass 2 (worker_update_decompress,
W=4 records) reads m and e and writes both (16). References: torch's sum over m and over e (a
read-only pass over the same 8 bytes), and ``torch.add(m, e, out=o)`` (12 bytes).

Run: python bench/bench_kernel_floor.py [--log2 24] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from compcomm import _C
from compcomm._buffers import buffer_of as B


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log2", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    K, n = _C.kernels, 2**args.log2
    m, e, o = torch.randn(n), torch.randn(n) * 0.1, torch.empty(n)
    scale, signs = torch.zeros(1), torch.zeros(n // 8, dtype=torch.uint8)
    records, ws = torch.zeros(16 + n // 8, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    rows = {
        "pass 1 worker_scale_pack": (8, lambda: K.worker_scale_pack(B(m), B(e), B(scale), B(signs),
                                                                    B(ws))),
        "pass 2 worker_update_decompress": (16, lambda: K.worker_update_decompress(
            B(m), B(e), B(scale), B(records.view(torch.float32)), 4,
            _C.Buffer(records.data_ptr() + 16, n // 8, _C.DType.uint8, -1), n // 8, 1)),
        "torch m.sum(), e.sum()": (8, lambda: (m.sum(), e.sum())),
        "torch.add(m, e, out=o)": (12, lambda: torch.add(m, e, out=o)),
    }
    print(f"2^{args.log2} fp32, 1 thread, load average {os.getloadavg()}")
    for r in range(args.rounds):
        out = []
        for name, (nbytes, f) in rows.items():
            f()
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
            t = statistics.median(ts)
            out.append(f"{name}: {t * 1e3:.1f} ms ({nbytes * n / t / 1e9:.1f} GB/s)")
        print(f"round {r + 1}: " + "; ".join(out))


if __name__ == "__main__":
    main()
