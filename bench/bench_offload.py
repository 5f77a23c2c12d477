"""ZeRO-Offload (issue 17): three measurements in one run, ratios within the run.

(a) ``kernel``: the C++ CPU Adam (``cpu_adam.adam_step_``) against ``torch.optim.AdamW``
    (foreach=True) on ``--numel`` fp32 parameters (default 2^26) at all cores; target >= 4x on 16.
(b) ``model``: a GPT-like model (bf16 parameters) at W=1, ZeRO stage 2 AdamW, with and without
    ``offload_optimizer``: median step time, device memory (``torch.cuda.memory_allocated`` after a
    step -- the model states: parameters, staging -- and ``max_memory_allocated``, which adds
    activations and the transient gradients) against ``estimate_memory(...)["device"]``
    (target within 10%), host bytes from ``memory_bytes()``, and the largest parameter difference
    between the two runs after the same steps (same data, same initial values).
(c) ``cap`` (CUDA only): ``torch.cuda.set_per_process_memory_fraction`` set between the offload
    run's peak and the no-offload run's, and below the fp32 Adam state of the model (8 bytes per
    parameter, which therefore cannot be on the GPU): the no-offload optimizer must fail with
    out-of-memory (caught and reported), the offload one must train ``--cap-steps`` steps.
(d) ``placement``: where OneBitAdam's 1-bit work on a bucket should run with offload
    (``onebit_placement``): per bucket of ``--bucket`` elements (bf16 gradient, fp32 momentum),
    the rank's own work of a compressed step -- the momentum from its 1-bit form and the local
    gradient, the compressed allreduce's kernels (worker pass, server pass, decompress), and the
    result's way into the host momentum shard -- on the device ("device": the chunk's fp32 values
    cross PCIe, what onebit_placement="device" does; "device_1bit": only the signs and the scale
    of the rank's chunk cross PCIe and are unpacked on the host) and on the host ("host": the bf16 gradient crosses PCIe, everything
    else on the CPU). The compressed allreduce runs at one rank (its collectives are copies, its
    kernels all run, the server's over the whole bucket); the network is left out (the same bytes
    on the wire for both placements). Also: device bytes per element each placement keeps.

Every section checks the time left against ``--time-limit`` (seconds) and is skipped, with a
note, when it cannot finish. ``--device cpu`` runs (a) and (b) on a small model (a smoke test).

Run: python bench/bench_offload.py --device cuda --out offload_gpu.md
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time
import traceback
from typing import Any, Callable, Dict, List

import torch

from compcomm.optim.cpu_adam import adam_step_, kernel_isa
from compcomm.zero import ZeroOptimizer, estimate_memory

T0 = time.monotonic()


class GPT(torch.nn.Module):
    """Pre-norm transformer decoder (causal self-attention blocks), tied to nothing."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, hidden)
        self.pos = torch.nn.Embedding(seq, hidden)
        self.blocks = torch.nn.ModuleList([
            torch.nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0,
                                             batch_first=True, norm_first=True)
            for _ in range(layers)])
        self.ln = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(n, device=idx.device))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n, device=idx.device,
                                                                    dtype=x.dtype)
        for b in self.blocks:
            x = b(x, src_mask=mask, is_causal=True)
        return self.head(self.ln(x))


def left(limit: float) -> float:
    return limit - (time.monotonic() - T0)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_time(fn: Callable[[], None], repeats: int, dev: torch.device) -> float:
    fn()  # warm-up: allocates the state
    times = []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- (a) ---------------------------------------------------------------------------------------

def bench_kernel(numel: int, repeats: int) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    p = torch.nn.Parameter(torch.randn(numel, generator=g))
    p.grad = torch.randn(numel, generator=g) * 1e-2
    opt = torch.optim.AdamW([p], foreach=True, **hp)
    w = p.detach().clone()
    m, v = torch.zeros(numel), torch.zeros(numel)
    state = {"step": 0}

    def kernel() -> None:
        state["step"] += 1
        adam_step_(w, m, v, p.grad, hp, state["step"])

    # rounds alternate the two, so that load from other processes weighs on both alike
    times: Dict[str, List[float]] = {"torch": [], "kernel": []}
    opt.step()
    kernel()
    for _ in range(repeats):
        for key, fn in (("torch", opt.step), ("kernel", kernel)):
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    t_torch, t_kernel = (statistics.median(times[k]) for k in ("torch", "kernel"))
    return {"numel": numel, "threads": torch.get_num_threads(), "torch_foreach_s": t_torch,
            "kernel_s": t_kernel, "speedup": t_torch / t_kernel}


# ---- (b), (c) ----------------------------------------------------------------------------------

def build(args: argparse.Namespace, dev: torch.device, offload: bool):
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bf16 on the device: no fp32 transient
    try:
        with torch.device(dev):
            model = GPT(args.vocab, args.hidden, args.layers, args.heads, args.seq)
    finally:
        torch.set_default_dtype(old)
    zero: Dict[str, Any] = {"reduce_bucket_size": args.bucket, "overlap_comm": True}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    z = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, module=model,
                      optimizer_kwargs={"lr": 1e-4, "weight_decay": 0.01}, **zero)
    return model, z


def train_step(model: torch.nn.Module, z: ZeroOptimizer, args: argparse.Namespace,
               dev: torch.device, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(dev)
    logits = model(idx[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, args.vocab),
                                             idx[:, 1:].reshape(-1))
    loss.backward()
    z.step()


def bench_model(args: argparse.Namespace, dev: torch.device) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    params = {}
    if dev.type == "cuda":  # the library workspaces (cuBLAS) exist before either run is built
        for dt in (torch.bfloat16, torch.float32):
            x = torch.ones(64, 64, device=dev, dtype=dt)
            (x @ x).sum().item()
        del x
    for offload in (False, True):
        key = "offload" if offload else "no_offload"
        baseline = 0
        if dev.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
            baseline = torch.cuda.memory_allocated(dev)
        t_build = time.perf_counter()
        model, z = build(args, dev, offload)
        t_build = time.perf_counter() - t_build
        build_peak = 0
        if dev.type == "cuda":
            build_peak = torch.cuda.max_memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        counter = iter(range(10**6))
        times = []
        for _ in range(args.steps):
            sync(dev)
            t0 = time.perf_counter()
            train_step(model, z, args, dev, next(counter))
            sync(dev)
            times.append(time.perf_counter() - t0)
        mem = z.memory_bytes()
        row = {"build_s": t_build, "build_peak": build_peak, "step_s": statistics.median(times[1:] or times),
               "first_step_s": times[0], "device_bytes": mem["device"], "host_bytes": mem["host"],
               "buffers_bytes": mem["buffers"],
               "device_buffers_bytes": mem["buffers_device"], "baseline": baseline}
        if dev.type == "cuda":
            # blocks freed while a side-stream copy still read them are released once the
            # allocator sees the copy's event done: let it look (it keeps what is cached)
            torch.cuda.empty_cache()
            row["allocated_after_step"] = torch.cuda.memory_allocated(dev)
            row["max_allocated"] = torch.cuda.max_memory_allocated(dev)
        if offload:
            row["kernel_steps"] = z.offload.kernel_steps
        params[key] = [p.detach().float().cpu() for p in model.parameters()]
        out[key] = row
        z.close()
        del model, z
    T = sum(p.numel() for p in params["offload"])
    out["numel"] = T
    out["max_param_diff"] = max(float((a - b).abs().max())
                                for a, b in zip(params["offload"], params["no_offload"]))
    for key, off in (("no_offload", None), ("offload", "optimizer")):
        est = estimate_memory(T, 2, 1, off, param_bytes=2)
        out[key]["estimate_device"] = est["device"]
        out[key]["estimate_host"] = est["host"]
    return out


def cuda_index(dev: torch.device) -> int:
    """The CUDA ordinal of ``dev`` (``--device cuda`` has none: the current device)."""
    return dev.index if dev.index is not None else torch.cuda.current_device()


def init_nccl(dev: torch.device) -> str:
    """A torch.distributed NCCL group of one rank: ZeroOptimizer then uses compcomm's NCCL
    communicator instead of the in-process one (the fallback if (b) fails with the latter)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("nccl", rank=0, world_size=1,
                            device_id=torch.device("cuda", cuda_index(dev)))
    return "torch.distributed nccl (world 1)"


def bench_cap(args: argparse.Namespace, dev: torch.device, model_res: Dict[str, Any]) -> Dict[str, Any]:
    off, full = model_res["offload"], model_res["no_offload"]
    need_off = max(off["max_allocated"], off["build_peak"])
    need_full = max(full["max_allocated"], full["build_peak"])
    adam_state = 8 * model_res["numel"]  # fp32 exp_avg + exp_avg_sq: must not fit under the cap
    cap = min(int(need_off * 1.25), int(need_full * 0.7), adam_state)
    if cap <= need_off * 1.05:
        return {"note": f"cannot separate: offload peak {need_off}, no-offload peak {need_full}, "
                        f"fp32 Adam state {adam_state}"}
    idx = cuda_index(dev)  # set_per_process_memory_fraction refuses a device without an index
    total = torch.cuda.get_device_properties(idx).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total, idx)
    res: Dict[str, Any] = {"cap_bytes": cap, "adam_state_bytes": adam_state}
    try:
        for offload in (False, True):
            key = "offload" if offload else "no_offload"
            try:
                model, z = build(args, dev, offload)
                for s in range(args.cap_steps):
                    train_step(model, z, args, dev, s)
                sync(dev)
                res[key] = f"trained {args.cap_steps} steps"
                z.close()
                del model, z
            except Exception as e:  # OOM may also surface as a RuntimeError from a library
                msg = (str(e).splitlines() or [""])[0][:160]
                oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in msg.lower()
                res[key] = ("out of memory: " if oom else f"error {type(e).__name__}: ") + msg
            gc.collect()
            torch.cuda.empty_cache()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, idx)
    res["ok"] = res.get("no_offload", "").startswith("out of memory") and res.get(
        "offload", "").startswith("trained")
    return res


# ---- (d) ---------------------------------------------------------------------------------------

def bench_placement(numel: int, repeats: int, dev: torch.device, total: int) -> Dict[str, Any]:
    from compcomm import _C, compressed_allreduce
    from compcomm.collectives import padded_numel
    from compcomm.zero.packed_momentum import pack, unpack

    comm = _C.LocalCommunicator()
    n = padded_numel(numel, 1)
    cuda = dev.type == "cuda"
    host = torch.device("cpu")
    b1 = 0.9
    g = torch.Generator().manual_seed(0)
    grad_dev = (torch.randn(n, generator=g) * 1e-2).to(torch.bfloat16).to(dev)
    m0 = torch.randn(n, generator=g) * 1e-2
    signs0, scales0 = pack(m0, n)  # the momentum's 1-bit form (one chunk at one rank)

    def buffers(where: torch.device) -> Dict[str, torch.Tensor]:
        return {"we": torch.zeros(n, device=where), "se": torch.zeros(n, device=where),
                "signs": signs0.to(where), "scales": scales0.to(where),
                "y": torch.empty(n, device=where)}

    pin = cuda
    shard = torch.empty(n, pin_memory=pin)  # the host momentum shard (one rank: the bucket)
    g_host = torch.empty(n, dtype=torch.bfloat16, pin_memory=pin)
    s_host = torch.empty(n // 8, dtype=torch.uint8, pin_memory=pin)
    t_host = torch.empty(1, pin_memory=pin)

    def allreduce(bf: Dict[str, torch.Tensor], where: torch.device) -> None:
        compressed_allreduce(bf["y"], bf["we"], bf["se"], group=comm)

    def local_momentum(bf: Dict[str, torch.Tensor], grad: torch.Tensor) -> None:
        unpack(bf["signs"], bf["scales"], n, numel, 0, bf["y"], mul=b1)
        bf["y"].add_(grad, alpha=1 - b1)

    on_dev = buffers(dev)

    def device_step(fp32: bool) -> None:
        local_momentum(on_dev, grad_dev)
        allreduce(on_dev, dev)
        if fp32:  # the chunk's values to the host shard
            shard.copy_(on_dev["y"], non_blocking=pin)
            sync(dev)
        else:  # its 1-bit form (the exchange's records hold it: a buffer of that size here)
            s_host.copy_(on_dev["signs"], non_blocking=pin)
            t_host.copy_(on_dev["scales"], non_blocking=pin)
            sync(dev)
            unpack(s_host, t_host, n, numel, 0, shard)

    on_host = buffers(host)

    def host_step() -> None:
        g_host.copy_(grad_dev, non_blocking=pin)
        sync(dev)
        local_momentum(on_host, g_host)
        allreduce(on_host, host)
        shard.copy_(on_host["y"])

    runs = {"device": lambda: device_step(True), "device_1bit": lambda: device_step(False),
            "host": host_step}
    times: Dict[str, List[float]] = {k: [] for k in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(repeats):  # alternating, so that other load weighs on all alike
        for key, fn in runs.items():
            sync(dev)
            t0 = time.perf_counter()
            fn()
            sync(dev)
            times[key].append(time.perf_counter() - t0)
    out: Dict[str, Any] = {"numel": numel, "total": total, "threads": torch.get_num_threads()}
    for key, ts in times.items():
        out[key + "_s"] = statistics.median(ts)
    # bytes over PCIe per element and what each keeps on the device, per element (one rank)
    out["pcie_bytes_per_elem"] = {"device": 4.0, "device_1bit": 1 / 8, "host": 2.0}
    out["device_bytes_per_elem"] = {"device": 4 + 4 + 1 / 8, "device_1bit": 4 + 4 + 1 / 8,
                                    "host": 0.0}
    best = min(("device", "device_1bit", "host"), key=lambda k: out[k + "_s"])
    out["faster"] = best
    out["ratio"] = out["host_s"] / out["device_s"]
    return out


# ---- report ------------------------------------------------------------------------------------

def gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


def markdown(res: Dict[str, Any], args: argparse.Namespace, dev: torch.device) -> str:
    lines = ["# ZeRO-Offload benchmark (bench/bench_offload.py)", ""]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    lines.append(f"device {name}; CPU {platform.processor() or '?'} x {os.cpu_count()} cores, "
                 f"kernel ISA {kernel_isa()}; torch {torch.__version__}; total "
                 f"{time.monotonic() - T0:.1f} s")
    lines.append(f"communicator: {res.get('comm', 'in-process (world of one rank)')}")
    lines.append("")
    a = res.get("kernel")
    lines.append("## (a) CPU Adam step: C++ kernel vs torch.optim.AdamW(foreach=True)")
    if isinstance(a, dict):
        lines += ["", "| params | threads | torch foreach (s) | kernel (s) | speedup |", "|---|---|---|---|---|",
                  f"| {a['numel']} | {a['threads']} | {a['torch_foreach_s']:.4f} | "
                  f"{a['kernel_s']:.4f} | {a['speedup']:.2f}x |", "",
                  f"target >= 4x on 16 cores ({a['threads']} threads here): "
                  f"{'met' if a['speedup'] >= 4 else 'NOT met'}"]
    else:
        lines.append(f"\n{a}")
    lines += ["", "## (b) GPT-like model, W=1, ZeRO stage 2 AdamW, bf16 parameters", ""]
    b = res.get("model")
    if isinstance(b, dict):
        lines.append(f"{b['numel'] / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} "
                     f"layers, vocab {args.vocab}, batch {args.batch} x {args.seq}), "
                     f"reduce_bucket_size {args.bucket}, {args.steps} steps (median of all but "
                     "the first)")
        lines += ["", "| run | step (s) | device (memory_bytes) | estimate device | "
                  "allocated after step | / estimate | peak in training | peak in building | "
                  "host (memory_bytes) | estimate host |", "|---|---|---|---|---|---|---|---|---|---|"]
        for key in ("no_offload", "offload"):
            r = b[key]
            alloc, peak = r.get("allocated_after_step"), r.get("max_allocated")
            cells = [key, f"{r['step_s']:.4f}", gib(r["device_bytes"]), gib(r["estimate_device"]),
                     gib(alloc) if alloc else "-",
                     f"{alloc / r['estimate_device']:.3f}" if alloc else "-",
                     gib(peak) if peak else "-", gib(r["build_peak"]) if peak else "-",
                     gib(r["host_bytes"]), gib(r["estimate_host"])]
            lines.append("| " + " | ".join(cells) + " |")
        ratio = b["offload"]["step_s"] / b["no_offload"]["step_s"]
        lines += ["", f"offload step / no-offload step: {ratio:.2f}x; C++ kernel steps "
                  f"{b['offload'].get('kernel_steps')}; largest parameter difference after "
                  f"{args.steps} steps: {b['max_param_diff']:.3g} (bf16 parameters)"]
        lines += ["", "Device memory of each run: allocated after a step minus allocated before "
                  "it was built (the process's library workspaces, cuBLAS, ~64 MiB, are there "
                  "before either run), against estimate_memory's device figure (DeepSpeed's "
                  "model-state formula, no buffers); split into memory_bytes' model states "
                  "(device) and device buffers (gradient staging: at most three pool buffers of "
                  "reduce_bucket_size elements), and the rest.", ""]
        for key in ("no_offload", "offload"):
            r = b[key]
            alloc = r.get("allocated_after_step")
            if not alloc:
                continue
            net = alloc - r["baseline"]
            off = net / r["estimate_device"] - 1
            rest = net - r["device_bytes"] - r["device_buffers_bytes"]
            lines.append(f"- {key}: {gib(net)} (allocated {gib(alloc)} - {gib(r['baseline'])}) = "
                         f"{net / r['estimate_device']:.3f} x estimate {gib(r['estimate_device'])}"
                         f" ({'within' if abs(off) <= 0.10 else 'NOT within'} 10%) = model "
                         f"states {gib(r['device_bytes'])} + staging "
                         f"{gib(r['device_buffers_bytes'])} + rest {gib(rest)}")
    else:
        lines.append(str(b))
    lines += ["", "## (c) memory cap: no offload must fail, offload must train", ""]
    c = res.get("cap", "not run")
    if isinstance(c, dict) and "cap_bytes" in c:
        fits = "does not fit" if c["adam_state_bytes"] > c["cap_bytes"] else "FITS"
        lines += [f"cap {gib(c['cap_bytes'])}; the model's fp32 Adam state "
                  f"{gib(c['adam_state_bytes'])} (8 bytes per parameter) {fits} under it",
                  f"- no offload: {c.get('no_offload')}", f"- offload: {c.get('offload')}",
                  f"- {'met' if c.get('ok') else 'NOT met'}"]
    else:
        lines.append(str(c))
    lines += ["", "## (d) OneBitAdam with offload: the 1-bit work on the device or on the host", ""]
    d = res.get("placement")
    if isinstance(d, dict):
        lines += [f"per bucket of {d['numel']} elements (bf16 gradient, fp32 momentum), one rank "
                  f"(the compressed allreduce's kernels all run, the network is left out: the same "
                  f"for both), {d['threads']} CPU threads; per step: x "
                  f"{d['total'] / d['numel']:.1f} buckets ({d['total'] / 1e6:.1f}M elements, the model of (b))", "",
                  "| placement | per bucket (s) | per step (s) | PCIe bytes / element | "
                  "device bytes / element (error feedback, packed momentum) |",
                  "|---|---|---|---|---|"]
        for key in ("device", "device_1bit", "host"):
            lines.append(f"| {key} | {d[key + '_s']:.5f} | "
                         f"{d[key + '_s'] * d['total'] / d['numel']:.3f} | "
                         f"{d['pcie_bytes_per_elem'][key]:g} | "
                         f"{d['device_bytes_per_elem'][key]:g} |")
        if dev.type == "cpu":
            lines += ["", "(On the CPU both placements use the same memory and no PCIe: the "
                      "figures only show that the code runs; the choice needs the GPU run.)"]
        lines += ["", f"faster: **{d['faster']}** (host / device time: {d['ratio']:.2f}x); "
                  "onebit_placement's default is \"device\"" + (
                      "" if d["faster"] == "device" else
                      f" -- the measurement says \"{d['faster']}\": change the default")]
    else:
        lines.append(str(d))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="offload.md")
    ap.add_argument("--time-limit", type=float, default=140.0)
    ap.add_argument("--numel", type=int, default=None, help="(a): default 2^26 (cpu: 2^22)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--bucket", type=int, default=int(1e7))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cap-steps", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    args.numel = args.numel or (1 << 26 if cuda else 1 << 22)
    args.hidden = args.hidden or (2048 if cuda else 64)
    args.layers = args.layers or (8 if cuda else 2)
    args.vocab = args.vocab or (32000 if cuda else 500)
    if not cuda:
        args.heads = min(args.heads, 4)
    torch.set_num_threads(os.cpu_count() or 1)
    res: Dict[str, Any] = {}
    sections = [("kernel", 0.15, lambda: bench_kernel(args.numel, args.repeats)),
                ("model", 0.45, lambda: bench_model(args, dev))]
    if cuda:
        sections.append(("cap", 0.25, lambda: bench_cap(args, dev, res["model"])))
    sections.append(("placement", 0.1, lambda: bench_placement(
        args.bucket if cuda else 1 << 16, args.repeats, dev,
        (res["model"]["numel"] if isinstance(res.get("model"), dict) else args.bucket))))
    for name, share, fn in sections:
        if left(args.time_limit) < share * args.time_limit * 0.5:
            res[name] = f"skipped: {left(args.time_limit):.0f} s left of --time-limit"
            continue
        if name == "cap" and not isinstance(res.get("model"), dict):
            res[name] = "skipped: (b) did not complete"
            continue
        try:
            res[name] = fn()
        except Exception:  # recorded, and the remaining sections still run
            res[name] = "FAILED:\n```\n" + traceback.format_exc()[-3000:] + "```"
            if name == "model" and cuda and left(args.time_limit) > 0.4 * args.time_limit:
                print(res[name], flush=True)
                try:  # once more over NCCL (the in-process communicator failed)
                    res["comm"] = init_nccl(dev) + "; the in-process communicator failed: " + \
                        res[name].splitlines()[-2][:200]
                    gc.collect()
                    torch.cuda.empty_cache()
                    res[name] = fn()
                except Exception:
                    res[name] += "\nretry over NCCL FAILED:\n```\n" + \
                        traceback.format_exc()[-2000:] + "```"
        print(f"[{time.monotonic() - T0:.1f} s] {name}: {res[name]}", flush=True)
    text = markdown(res, args, dev)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
