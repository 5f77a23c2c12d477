"""compcomm's all-gather for FSDP2's parameters: a re-gather cache and a blockwise int8 all-gather.

FSDP2 all-gathers each module's parameters before its forward and, after
``reshard_after_forward`` (the default for all modules but the root), again before its backward:
about ``2 x 2P`` bytes per rank per step in bf16 (P parameters), 16x more than compcomm's 1-bit
reduce-scatter. :func:`compressed_allgather` installs an ``AllGather``
(``FSDPModule.set_custom_all_gather``) on every FSDP module with two independent parts:

* **Re-gather cache** (``cache=True``, exact). Within one optimizer step the parameters do not
  change, so a module's second gather is served from what its first one received, with no
  communication. An entry is kept per module that reshards after forward (what FSDP's root does
  not), compactly (the int8 payload when ``quantized``, else the gathered buffer), and released
  when it is served. Every entry is dropped, on every rank in lockstep, by
  :meth:`GatherState.invalidate`:
  called after every optimizer step (torch's global optimizer step post hook, or the hooks of the
  optimizers passed), after ``load_state_dict`` of any FSDP module, and by the user after changing
  parameters any other way. Whether a call is served from the cache depends only on the call
  sequence, the step hooks and the shapes, never on tensor values: the same on every rank as long
  as every rank steps the same optimizers (SPMD), or a rank would wait in a gather the others skip.
* **Quantized all-gather** (``quantized=True``). Each rank quantizes its exact shard blockwise to
  int8 (:mod:`compcomm.quantize`), the payloads are all-gathered as bytes and dequantized into
  FSDP's output buffer, this rank's own slot included: every rank computes with the same weights.
  The master shards stay exact (each step re-quantizes them). Blocks start at every parameter's
  shard within the flat input (read from FSDP's parameter list, the same on every rank; flat
  blocks when it cannot be read), 64 elements by default; parameters of <= ``exact_numel``
  elements (norm weights, biases) travel unquantized. The code rounds to nearest by default;
  ``rounding="stochastic"`` (unbiased, from FSDP's fp32 master when FSDP casts to bf16) is an
  option: it helped one CPU run and hurt on the GPU (docs/fsdp.md). Non-float gathers (e.g. FSDP's uint8 for float8
  tensors) go through unquantized.

The call is synchronous on the caller's stream (FSDP records its event right after it returns);
torch ops only, so it runs on CPU and CUDA alike. At world size 1 FSDP does not call it.
"""

from __future__ import annotations

import weakref
import zlib
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
from torch.optim.optimizer import register_optimizer_step_post_hook

from .errors import UnsupportedError
from .fsdp_hsdp import check_one_group
from .quantize import (DEFAULT_BLOCK, dequantize_blockwise, payload_bytes, quantize_blockwise,
                       round_stochastic)

__all__ = ["GatherState", "CompressedAllGather", "compressed_allgather", "DEFAULT_EXACT_NUMEL"]

#: parameters of at most this many elements (norm weights, biases) are gathered unquantized
DEFAULT_EXACT_NUMEL = 4096

# torch 2.13 renamed the tensor form of all_gather; older releases have only this one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class GatherState:
    """The state of :func:`compressed_allgather`: settings, cache and counters (this rank).

    Attributes
    ----------
    quantized, cache : bool
    block : int
    generation : int
        Bumped by every :meth:`invalidate`; an entry is served only in its generation.
    gathers, hits : int
        All-gathers run / served from the cache.
    bytes_sent : int
        Bytes this rank sent in its all-gathers, ring convention: ``(W-1)`` times its payload.
    logical_bytes : int
        What FSDP's own all-gather would have sent for every call (hits included).
    peak_cache_bytes : int
        The most bytes the cache held at once.
    """

    def __init__(self, quantized: bool, cache: bool, block: int, exact_numel: int = 0,
                 rounding: str = "nearest", seed: int = 0) -> None:  # compressed_allgather's
        self.quantized, self.cache, self.block = quantized, cache, block
        self.exact_numel, self.rounding, self.seed = exact_numel, rounding, seed
        self.generation = 0
        self.gathers = self.hits = self.bytes_sent = self.logical_bytes = 0
        self.peak_cache_bytes = 0
        self.storing = True  # the model's last forward ran with grad enabled (set by a hook)
        self._entries: Dict[str, Tuple[int, Tuple[Any, ...], torch.Tensor]] = {}
        self._handles: List[Any] = []

    def invalidate(self) -> None:
        """Drop every cached gather (call it on every rank, e.g. after changing parameters
        outside an optimizer step)."""
        self.generation += 1
        self._entries.clear()

    def cache_bytes(self) -> int:
        """Bytes the cache holds now."""
        return sum(e[2].numel() * e[2].element_size() for e in self._entries.values())

    def counters(self) -> Dict[str, int]:
        """``gathers``, ``hits``, ``bytes_sent``, ``logical_bytes``, ``peak_cache_bytes``."""
        return {"gathers": self.gathers, "hits": self.hits, "bytes_sent": self.bytes_sent,
                "logical_bytes": self.logical_bytes, "peak_cache_bytes": self.peak_cache_bytes}

    def remove(self) -> None:
        """Remove the invalidation hooks (the installed all-gathers stay)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.invalidate()

    def _store(self, name: str, key: Tuple[Any, ...], payload: torch.Tensor) -> None:
        self._entries[name] = (self.generation, key, payload)
        self.peak_cache_bytes = max(self.peak_cache_bytes, self.cache_bytes())


def _param_groups(module: Any) -> List[Any]:
    st = module._get_fsdp_state()
    return [g for g in (getattr(st, "_fsdp_param_groups", None)
                        or [getattr(st, "_fsdp_param_group", None)]) if g is not None]


def _reshards_after_forward(module: Any) -> bool:
    """Whether FSDP gathers ``module`` again for its backward (read from FSDP's state, which
    torch does not expose publicly; True when it cannot be read)."""
    try:
        return all(getattr(g, "post_forward_mesh_info", True) is not None
                   for g in _param_groups(module))
    except Exception:  # noqa: BLE001 - another torch's internals: cache it, which is safe
        return True


def _segments(module: Any, n: int, exact_numel: int = 0) -> Optional[List[Tuple[int, bool]]]:
    """(shard size, exact?) of each parameter in FSDP's flat all-gather input of ``module``
    (FSDP's parameter order; from shapes only, so the same on every rank): exact when the whole
    parameter has at most ``exact_numel`` elements. None (flat blocks, all quantized) when this
    torch's internals do not give ``n``."""
    try:
        groups = _param_groups(module)
        if len(groups) != 1:
            return None
        segs = [(int(fp._sharded_param_data.numel()), int(fp.sharded_param.numel()) <= exact_numel)
                for fp in groups[0].fsdp_params]
    except Exception:  # noqa: BLE001 - another torch's internals: flat blocks are correct too
        return None
    return segs if sum(n_ for n_, _ in segs) == n else None


def _master(module: Any, n: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The fp32 master shard behind FSDP's flat all-gather input of ``module`` when FSDP casts
    it to a narrower ``dtype`` (``MixedPrecisionPolicy(param_dtype=bf16)``), read from FSDP's
    parameters (torch internals); None when there is none or it cannot be read."""
    if dtype == torch.float32 or module is None:
        return None
    try:
        groups = _param_groups(module)
        fps = groups[0].fsdp_params if len(groups) == 1 else []
        data = [fp._sharded_param_data for fp in fps
                if getattr(fp.sharded_state, "name", "") == "SHARDED"
                and not getattr(fp, "offload_to_cpu", False)
                and not hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather")]
    except Exception:  # noqa: BLE001 - another torch's internals: the cast FSDP made
        return None
    if len(data) != len(fps) or not data or any(d.dtype != torch.float32 for d in data):
        return None
    flat = torch.cat([d.reshape(-1) for d in data])
    return flat if flat.numel() == n else None


class _Layout:
    """Where each parameter's shard goes in one rank's payload: the quantized ones first (one
    blockwise int8 payload, each starting a block), then the exact ones in the shard's dtype
    (padded to 4 bytes, so that the next rank's fp32 scales stay aligned)."""

    def __init__(self, n: int, segs: Optional[List[Tuple[int, bool]]], block: int,
                 dtype: torch.dtype) -> None:
        segs = segs if segs is not None else [(n, False)]
        offs = [sum(sz for sz, _ in segs[:i]) for i in range(len(segs))]
        self.q = [(o, sz) for o, (sz, ex) in zip(offs, segs) if not ex and sz]
        self.e = [(o, sz) for o, (sz, ex) in zip(offs, segs) if ex and sz]
        self.nq, self.ne = sum(sz for _, sz in self.q), sum(sz for _, sz in self.e)
        self.dtype, self.itemsize = dtype, torch.empty(0, dtype=dtype).element_size()
        self.qbytes = payload_bytes(self.nq, block, [sz for _, sz in self.q])
        self.bytes = self.qbytes + -(-self.ne * self.itemsize // 4) * 4
        self.all_quantized = not self.e and self.nq == n

    def encode(self, x: torch.Tensor, block: int, gen: Optional[torch.Generator]) -> torch.Tensor:
        if self.all_quantized:
            return quantize_blockwise(x, block, segments=[sz for _, sz in self.q], generator=gen)
        out = torch.zeros(self.bytes, dtype=torch.uint8, device=x.device)
        if self.q:
            xq = torch.cat([x[o: o + sz] for o, sz in self.q])
            quantize_blockwise(xq, block, out=out[: self.qbytes],
                               segments=[sz for _, sz in self.q], generator=gen)
        if self.e:
            xe = torch.cat([x[o: o + sz] for o, sz in self.e])
            if xe.dtype != self.dtype:  # from the fp32 master: the (stochastic) cast
                xe = round_stochastic(xe, self.dtype, gen)
            out[self.qbytes: self.qbytes + self.ne * self.itemsize].copy_(xe.view(torch.uint8))
        return out

    def decode(self, payload: torch.Tensor, out: torch.Tensor, block: int) -> None:
        world = payload.numel() // self.bytes
        if self.all_quantized:
            dequantize_blockwise(payload, self.nq, out, block, [sz for _, sz in self.q])
            return
        rows, dst = payload.view(world, self.bytes), out.view(world, -1)
        if self.q:
            tmp = torch.empty(world * self.nq, dtype=out.dtype, device=out.device)
            dequantize_blockwise(rows[:, : self.qbytes], self.nq, tmp, block,
                                 [sz for _, sz in self.q])
            tmp, c = tmp.view(world, self.nq), 0
            for o, sz in self.q:
                dst[:, o: o + sz].copy_(tmp[:, c: c + sz])
                c += sz
        if self.e:
            raw = rows[:, self.qbytes: self.qbytes + self.ne * self.itemsize].contiguous()
            ex, c = raw.view(out.dtype), 0
            for o, sz in self.e:
                dst[:, o: o + sz].copy_(ex[:, c: c + sz])
                c += sz


class CompressedAllGather(AllGather):
    """FSDP2 ``AllGather`` of one module (see the module docstring)."""

    def __init__(self, state: GatherState, name: str, module: Any) -> None:
        self.state, self.name = state, name
        self._module = weakref.ref(module)
        self._layouts: Dict[Tuple[int, torch.dtype], _Layout] = {}
        self._gen: Optional[torch.Generator] = None

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def _layout(self, n: int, dtype: torch.dtype) -> _Layout:
        lay = self._layouts.get((n, dtype))
        if lay is None:
            module, st = self._module(), self.state
            segs = _segments(module, n, st.exact_numel) if module is not None else None
            lay = self._layouts[(n, dtype)] = _Layout(n, segs, st.block, dtype)
        return lay

    def _generator(self, device: torch.device, rank: int) -> Optional[torch.Generator]:
        """Stochastic rounding's generator, reseeded from (seed, module, rank, generation): a
        re-gather in the same step draws the same numbers, as the forward's gather did."""
        st = self.state
        if st.rounding != "stochastic":
            return None
        if self._gen is None or self._gen.device != device:
            self._gen = torch.Generator(device=device)
        key = f"{st.seed}/{self.name}/{rank}/{st.generation}".encode()
        self._gen.manual_seed(zlib.crc32(key) | (st.generation << 32))
        return self._gen

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Optional[dist.Work]:
        st = self.state
        world, n = group.size(), input_tensor.numel()
        quant = st.quantized and output_tensor.dtype in _FLOATS
        module = self._module()
        lay = self._layout(n, output_tensor.dtype) if quant else None
        key = (n, world, output_tensor.dtype, output_tensor.device, quant, st.block,
               None if lay is None else (tuple(lay.q), tuple(lay.e)))
        st.logical_bytes += (world - 1) * n * input_tensor.element_size()
        entry = st._entries.pop(self.name, None) if st.cache else None
        if entry is not None and entry[0] == st.generation and entry[1] == key:
            payload = entry[2]
            if payload.is_cuda:  # read on this stream; freed when done here
                payload.record_stream(torch.cuda.current_stream(payload.device))
            if lay is not None:
                lay.decode(payload, output_tensor, st.block)
            else:
                output_tensor.copy_(payload)
            st.hits += 1
            return None
        st.gathers += 1
        gen = self._generator(input_tensor.device, group.rank())
        # stochastic rounding starts from the fp32 master, not from FSDP's rounded bf16 cast
        src = _master(module, n, input_tensor.dtype) if gen is not None and (
            output_tensor.dtype in _FLOATS) else None
        if lay is not None:
            local = lay.encode(input_tensor.reshape(-1) if src is None else src, st.block, gen)
            payload = torch.empty(world * local.numel(), dtype=torch.uint8, device=local.device)
            _all_gather(payload, local, group=group)
            lay.decode(payload, output_tensor, st.block)
            st.bytes_sent += (world - 1) * local.numel()
        else:
            if src is not None:  # this rank's slot: the stochastic cast of the master
                input_tensor.view(-1).copy_(round_stochastic(src, input_tensor.dtype, gen))
            _all_gather(output_tensor, input_tensor, group=group)
            st.bytes_sent += (world - 1) * n * input_tensor.element_size()
            payload = output_tensor
        # a forward without grad (eval) has no backward to serve: its gathers are not kept, or
        # weights swapped in for it (EMA) would be served to the next training forward
        if st.cache and st.storing and module is not None and _reshards_after_forward(module):
            st._store(self.name, key, payload if lay is not None else payload.clone())
        return None


def _optimizers(optimizer: Any) -> List[torch.optim.Optimizer]:
    opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    for o in opts:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"compcomm.fsdp: argument 'optimizer' must be a torch.optim.Optimizer "
                            f"or a list of them, got {type(o).__name__}")
    return opts


def _install_hooks(state: GatherState, modules: Iterable[Any], optimizer: Any,
                   root: Any = None) -> None:
    ref = weakref.ref(state)  # the global hook must not keep the state alive

    def invalidate(*_: Any) -> None:
        s = ref()
        if s is not None:
            s.invalidate()

    if optimizer is None:
        state._handles.append(register_optimizer_step_post_hook(invalidate))
    else:
        state._handles.extend(o.register_step_post_hook(invalidate) for o in _optimizers(optimizer))
    for m in modules:
        state._handles.append(m.register_load_state_dict_post_hook(invalidate))

    def grad_mode(*_: Any) -> None:
        s = ref()
        if s is not None:
            s.storing = torch.is_grad_enabled()

    if root is not None:  # before FSDP's own pre-forward, which gathers
        state._handles.append(root.register_forward_pre_hook(grad_mode, prepend=True))


def compressed_allgather(model: torch.nn.Module, *, quantized: bool = True, cache: bool = True,
                         block: int = DEFAULT_BLOCK, optimizer: Any = None,
                         exact_numel: int = DEFAULT_EXACT_NUMEL,
                         rounding: str = "nearest") -> GatherState:
    """Install compcomm's all-gather on every FSDP2 module of ``model``.

    Parameters
    ----------
    model : torch.nn.Module
        A model whose submodules (and/or itself) were wrapped with ``fully_shard`` (one parameter
        group per module: FSDP2's custom all-gather refuses more).
    quantized : bool, default True
        Blockwise int8 all-gather (about 2x fewer bytes than bf16, 4x fewer than fp32; the
        weights every rank computes with are the dequantized ones).
    cache : bool, default True
        Serve the backward's re-gather from the forward's gather (exact).
    block : int, default 64
        Elements per absmax block (a multiple of 4).
    optimizer : torch.optim.Optimizer or list of them, optional
        Whose steps invalidate the cache; default: any optimizer's step (torch's global hook).
    exact_numel : int, default 4096
        With ``quantized``: parameters of at most this many elements (norm weights, biases) are
        gathered in FSDP's dtype, not int8 (a LayerNorm weight near 1 has int8 steps of ~1/127).
    rounding : {"nearest", "stochastic"}, default "nearest"
        How the int8 code (and, with bf16 parameters, the cast from FSDP's fp32 master) rounds:
        to nearest (FSDP's own cast; the int8 code rounds half to even), or stochastically
        (unbiased: an update below half a step still moves the expected weight; each rank draws
        for its own shard, reseeded per step and module so that a re-gather matches). Stochastic
        rounding trained worse on the GPU (docs/fsdp.md): an option, not the default.

    Returns
    -------
    GatherState
        Counters, ``invalidate()``, ``remove()``.

    Raises
    ------
    ValueError
        ``model`` has no FSDP module, neither part is on, a bad ``block``, or a module of
        several FSDP parameter groups (nothing is installed then).
    UnsupportedError
        This torch has no ``FSDPModule.set_custom_all_gather`` (torch < 2.9).
    """
    if rounding not in ("nearest", "stochastic"):
        raise ValueError("compcomm.fsdp.compressed_allgather: argument 'rounding' must be "
                         f"'nearest' or 'stochastic', got {rounding!r}")
    if not (quantized or cache or rounding == "stochastic"):
        raise ValueError("compcomm.fsdp.compressed_allgather: arguments 'quantized' and 'cache' "
                         "are both False and rounding is 'nearest' (nothing to install)")
    payload_bytes(0, block)  # validates block
    if isinstance(exact_numel, bool) or not isinstance(exact_numel, int) or exact_numel < 0:
        raise ValueError("compcomm.fsdp.compressed_allgather: argument 'exact_numel' must be an "
                         f"integer >= 0, got {exact_numel!r}")
    mods = [(n or "<root>", m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not mods:
        raise ValueError("compcomm.fsdp.compressed_allgather: argument 'model' has no FSDP module "
                         "(wrap it with torch.distributed.fsdp.fully_shard first)")
    if not hasattr(mods[0][1], "set_custom_all_gather"):
        raise UnsupportedError(f"compcomm.fsdp: torch {torch.__version__} has no "
                               "FSDPModule.set_custom_all_gather (torch >= 2.9 needed for the "
                               "compressed all-gather)", "all_gather", "fsdp")
    if optimizer is not None:
        _optimizers(optimizer)  # checked before anything is installed
    check_one_group(mods, "compcomm.fsdp.compressed_allgather")
    state = GatherState(bool(quantized), bool(cache), block, exact_numel, rounding)
    for name, m in mods:
        m.set_custom_all_gather(CompressedAllGather(state, name, m))
    if cache or rounding == "stochastic":  # both need the step's generation
        _install_hooks(state, [m for _, m in mods], optimizer, root=model)
    return state
