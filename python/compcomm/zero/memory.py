"""Memory estimates for ZeRO: DeepSpeed's estimator formulas and compcomm's own per-kind breakdown."""

from __future__ import annotations

from typing import Any, Dict, Optional, Union

import torch

__all__ = ["estimate_memory", "model_numels", "measure"]


def model_numels(model: torch.nn.Module) -> tuple:
    """(total parameters counting shared ones once, largest per-module non-recursive count)."""
    seen = set()
    total = 0
    largest = 0
    for m in model.modules():
        own = 0
        for p in m.parameters(recurse=False):
            own += p.numel()
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        largest = max(largest, own)
    return total, largest


def _tensor_bytes(state: Any) -> int:
    return sum(v.numel() * v.element_size() for st in state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def measure(zo: Any) -> Dict[str, int]:
    """What :meth:`ZeroOptimizer.memory_bytes` returns, measured on the live tensors of ``zo``.

    ``device`` + ``host`` = ``params + grads + master + optimizer_state``; ``host`` is what
    ZeRO-Offload keeps in host memory (the master, gradient and optimizer-state shards with
    ``offload_optimizer``, the parameter shards with ``offload_param``), 0 without offload
    (also on a CPU-only run, where "device" memory is host memory too). ``buffers`` is not in
    either: ``buffers_host`` of it are offload's host copies (and with ``onebit_placement``
    "host" the 1-bit buffers, whose packed momentum then counts in ``host``), ``buffers_device``
    the rest (gradient
    staging -- a few ``reduce_bucket_size`` buffers --, 1-bit error feedback and workspaces), the
    term DeepSpeed's estimator formulas leave out."""
    out = {"params": 0, "grads": 0, "master": 0}
    for grp in zo.groups:
        for k, n in grp.nbytes().items():
            out[k] += n
    buffers = zo._grads.nbytes()
    rep = zo._replicated
    # offload with onebit_placement "host": the 1-bit buffers and momentum are in host memory
    onebit_host = rep is not None and rep.where != zo.device
    onebit_buffers = sum(zo.compressor.nbytes()) if zo.compressor is not None else 0
    buffers += onebit_buffers  # error buffers and exchange workspaces of the buckets
    inner_state = _tensor_bytes(zo.optimizer.state)
    state = inner_state
    if rep is not None:  # the momentum (no_allgather: variance, master) in full
        state += rep.nbytes()
    if hasattr(zo.optimizer, "memory_bytes"):  # a 1-bit optimizer's own error feedback
        inner = zo.optimizer.memory_bytes()
        state += inner["error_feedback"]
        buffers += inner["buffers"]
    host = rep.nbytes() if onebit_host else 0
    buffers_host = onebit_buffers if onebit_host else 0
    off = zo.offload
    if off is not None:
        buffers_host += off.nbytes()
        buffers += off.nbytes()
        if off.optimizer:
            idle = off.idle_grad_bytes(zo.groups)
            out["grads"] += idle
            host += out["master"] + inner_state + idle + sum(
                grp.master.grad.numel() * 4 for grp in zo.groups if grp.master.grad is not None)
        if off.param and zo.stage == 3:
            host += sum(g.param_shard.numel() * g.param_shard.element_size() for g in zo.groups)
    total = sum(out.values()) + state
    return dict(out, optimizer_state=state, buffers=buffers, device=total - host, host=host,
                buffers_host=buffers_host, buffers_device=buffers - buffers_host)


def estimate_memory(
    model_or_numel: Union[torch.nn.Module, int],
    stage: int,
    world_size: int,
    offload: Optional[str] = None,
    *,
    largest_layer: Optional[int] = None,
    gpus_per_node: Optional[int] = None,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
    zero_init: bool = True,
    param_bytes: int = 2,
    optimizer_state_bytes: int = 8,
    onebit: Optional[str] = None,
    onebit_mode: Optional[str] = None,
) -> Dict[str, Any]:
    """Per-rank bytes of a ZeRO setup.

    Parameters
    ----------
    model_or_numel : torch.nn.Module or int
        The model (shared parameters counted once; the largest layer is the largest per-module,
        non-recursive parameter count) or the total parameter count T.
    stage : {0, 1, 2, 3}
        ZeRO stage.
    world_size : int
        Data-parallel ranks (DeepSpeed's G, total GPUs).
    offload : {None, "optimizer", "optimizer+param"}
        ZeRO-Offload: ``offload_optimizer`` (stages 1-3), and ``offload_param`` too (stage 3).
        Moves ``master``, ``optimizer_state`` (the wrapped optimizer's shards) and the fp32
        gradient shard (stage 1: a persistent one, counted in ``grads``) to ``host``, and with
        "optimizer+param" the parameter shards; also selects DeepSpeed's offload formulas.
    largest_layer : int, optional
        L when ``model_or_numel`` is a count (default: T).
    gpus_per_node, num_nodes, additional_buffer_factor, zero_init
        DeepSpeed's g (default: world_size / num_nodes), m, f and zero_init.
    param_bytes : int
        Bytes of a model parameter element (2 for fp16/bf16, 4 for fp32).
    optimizer_state_bytes : int
        Optimizer state bytes per element (8 for Adam's two fp32 moments).
    onebit : {None, "OneBitAdam", "ZeroOneAdam"}
        The 1-bit optimizer wrapped by ZeroOptimizer, if any. ``"OneBitAdam"``: the compressed
        phase, which adds ``buffers`` -- the fp32 error feedback (a full-length worker error and the
        rank's server chunk, ``4 (T + T/G)``) and, in stage 2/3, the staged local gradient
        (``param_bytes * T``). ``"ZeroOneAdam"`` (stage 1/2): its local-step phase, which runs
        unsharded: whole gradients, and as optimizer state the momentum, the frozen variance, the
        accumulated update (``12 T``), the error feedback ``4 (T + T/G)`` and, for parameters of
        fewer than 4 bytes, fp32 masters (``4 T``).
    onebit_mode : {None, "exact", "no_allgather", "sharded"}
        With ``onebit="OneBitAdam"``: ZeroOptimizer's ``onebit_mode`` (None: "exact"). "exact" adds
        the replicated momentum in its 1-bit form (``T/8``: a sign bit per element; plus one fp32
        scale per chunk, ``4 G`` bytes per bucket, not counted; with one rank nothing is
        compressed and it stays fp32, ``4 T``) to ``optimizer_state``; "no_allgather" also the
        frozen variance (``4 T``) and, for parameters of fewer than 4 bytes, the fp32 master
        weights (``4 T``), on top of the shards. "sharded" adds
        nothing (the momentum stays a shard). The 1-bit exchange workspaces (about ``T/4`` bytes)
        are not counted.

    Returns
    -------
    dict
        ``params``, ``grads``, ``master``, ``optimizer_state``, ``buffers``: bytes one rank of
        compcomm's ZeroOptimizer holds for each (steady state after backward; padding, and
        communication buffers other than the 1-bit ones, excluded), and their sum ``total``.
        ``device`` and ``host``: where ``params + grads + master + optimizer_state`` are (``host``
        0 without offload), as :meth:`ZeroOptimizer.memory_bytes` reports them. ``gpu`` and
        ``cpu``: DeepSpeed's estimator
        formulas (ONEBIT_SPEC.md section f) for stage 2 and 3 (None for stages 0/1, where DeepSpeed
        has no estimator), in bytes.
    """
    if isinstance(model_or_numel, torch.nn.Module):
        T, L = model_numels(model_or_numel)
        if largest_layer is not None:
            L = int(largest_layer)
    else:
        T = int(model_or_numel)
        L = int(largest_layer) if largest_layer is not None else T
    if T < 0:
        raise ValueError(f"model_or_numel must be >= 0, got {T}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if offload not in (None, "none", "optimizer", "optimizer+param"):
        raise ValueError(f"offload must be None, 'optimizer' or 'optimizer+param', got {offload!r}")
    if offload == "none":
        offload = None
    if offload == "optimizer+param" and stage != 3:
        raise ValueError("offload='optimizer+param' needs stage 3")
    if offload is not None and stage == 0:
        raise ValueError("offload needs stage 1, 2 or 3")
    if offload is not None and onebit is not None and (onebit != "OneBitAdam"
                                                       or onebit_mode not in (None, "exact")):
        raise ValueError("offload: of the 1-bit optimizers only OneBitAdam with onebit_mode "
                         "'exact' runs with offload")
    if onebit not in (None, "OneBitAdam", "ZeroOneAdam"):
        raise ValueError(f"onebit must be None, 'OneBitAdam' or 'ZeroOneAdam', got {onebit!r}")
    if onebit is not None and stage == 0:
        raise ValueError("onebit: the 1-bit optimizers' own memory is the unsharded one (stage 0 "
                         "is not a ZeroOptimizer)")
    if onebit == "ZeroOneAdam" and stage == 3:
        raise ValueError("onebit='ZeroOneAdam' needs stage 1 or 2 (ZeroOptimizer rejects stage 3)")
    if onebit_mode not in (None, "exact", "no_allgather", "sharded"):
        raise ValueError("onebit_mode must be None, 'exact', 'no_allgather' or 'sharded', "
                         f"got {onebit_mode!r}")
    if onebit_mode is not None and onebit != "OneBitAdam":
        raise ValueError("onebit_mode applies only to onebit='OneBitAdam'")
    if onebit_mode == "no_allgather" and stage == 3:
        raise ValueError("onebit_mode='no_allgather' needs stage 1 or 2")
    G, m, f = world_size, num_nodes, additional_buffer_factor
    g = gpus_per_node if gpus_per_node is not None else max(1, G // max(1, m))
    b, k = param_bytes, optimizer_state_bytes

    # compcomm's own layout (no offload): what ZeroOptimizer.memory_bytes() measures.
    params = b * T if stage < 3 else b * T / G
    grads = b * T if stage <= 1 else 4 * T / G
    if stage == 0:
        master, state = 4 * T, k * T
    else:
        master, state = 4 * T / G, k * T / G
    buffers = 0.0
    errors = 4 * (T + T / G)  # 1-bit error feedback: worker error (full) + server error (chunk)
    if onebit == "OneBitAdam":
        buffers = errors + (b * T if stage >= 2 else 0)
        mode = onebit_mode or "exact"
        if mode in ("exact", "no_allgather"):  # the momentum, replicated (1-bit) after the freeze
            state += T / 8 if G > 1 else 4 * T
        if mode == "no_allgather":  # and the frozen variance, fp16/bf16: the fp32 master
            state += 4 * T + (4 * T if b < 4 else 0)
    elif onebit == "ZeroOneAdam":
        grads = b * T
        state = 12 * T + errors + (4 * T if b < 4 else 0)
    host = 0.0
    if offload is not None:
        if stage == 1:  # whole p.grad on the device plus the host's persistent fp32 shard
            grads += 4 * T / G
        host = master + k * T / G + 4 * T / G
        if offload == "optimizer+param":
            host += params
    out: Dict[str, Any] = {
        "params": int(params),
        "grads": int(grads),
        "master": int(master),
        "optimizer_state": int(state),
        "buffers": int(buffers),
        "total": int(params + grads + master + state + buffers),
        "device": int(params + grads + master + state - host),
        "host": int(host),
        "gpu": None,
        "cpu": None,
    }
    # DeepSpeed's estimators (estimate_zero2/3_model_states_mem_needs), bytes.
    if stage == 2:
        if offload is None:
            gpu, cpu = 2 * T + 18 * T / G, 4 * T * g * f
        else:
            gpu, cpu = 2 * T, T * max(4 * G, 16) * f
        out.update(gpu=int(gpu), cpu=int(cpu))
    elif stage == 3:
        if offload is None:
            gpu = 4 * L + 18 * T / G
            cpu = 4 * L * g * f if zero_init else 4 * T * g * f
        elif offload == "optimizer":
            gpu = 4 * L + 2 * T / G
            cpu = 16 * T / m * f if zero_init else T * max(4 * g, 16 / m) * f
        else:
            gpu = 4 * L
            cpu = 18 * T / m * f if zero_init else T * max(4 * g, 18 / m) * f
        out.update(gpu=int(gpu), cpu=int(cpu))
    return out
