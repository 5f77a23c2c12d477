"""ZeRO-Offload: the fp32 master shards and the optimizer state in host memory, the step on the CPU.

With ``offload_optimizer: {"device": "cpu"}`` (:class:`HostOffload`):

* every group's fp32 master shard and fp32 gradient shard live in host memory (pinned when the
  parameters are on a GPU and ``pin_memory`` is set), and so does the wrapped optimizer's state,
  which it creates next to the master shard;
* each reduced gradient chunk is copied to the host as soon as its reduction completes
  (:meth:`HostOffload.receive`, called by the gradient reducer bucket by bucket; on a GPU on a side
  stream, with an event, so the copies overlap backward) and added into the host gradient shard
  once its copy has finished (checked at each new chunk; :meth:`HostOffload.drain` waits for the
  rest when the step needs them);
* the step runs on the CPU: ``torch.optim.Adam`` / ``AdamW`` through the C++ kernels of
  :mod:`compcomm.optim.cpu_adam` on the wrapped optimizer's own state (so its state dict is
  torch's and checkpoints load with or without offload), in pieces of about
  :data:`PIECE` elements whose parameter-dtype copies are uploaded while the next piece is
  stepped; any other optimizer (or an Adam option the kernels lack) through its own ``step()``
  on the CPU tensors;
* the uploaded shards are what :func:`.param_gather.publish` all-gathers (stage 1/2) or keeps as
  the parameter shard (stage 3).

With ``offload_param`` (stage 3) the parameter shards live in host memory too and each gather
uploads the shard it sends (:class:`.param_gather.ParamGatherer`).

On a CPU-only machine the same host buffers, bucketed copies and pieces are used (without streams
or pinning), so the tests exercise the offload path.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..optim import cpu_adam
from .layout import GroupLayout

__all__ = ["HostOffload", "PIECE", "check_offload", "check_placement", "step_inner"]

#: elements per CPU-step piece (the unit of upload overlap; whole buckets are never split)
PIECE = 1 << 22


def check_offload(config: Dict[str, Any], onebit: Optional[str], mode: Optional[str]) -> None:
    """ValueError naming ``offload_optimizer`` for a 1-bit combination offload does not run:
    OneBitAdam runs with offload only in ``onebit_mode`` "exact" (its compressed phase then
    updates the host shards from the replicated momentum); ZeroOneAdam not at all."""
    if config["offload_optimizer"] is None or onebit is None:
        return
    if onebit == "OneBitAdam" and mode == "exact":
        return
    what = f"{onebit} with onebit_mode={mode!r}" if onebit == "OneBitAdam" else onebit
    raise ValueError(f"ZeroOptimizer: offload_optimizer is not supported with {what} "
                     "(OneBitAdam with onebit_mode 'exact' is; or drop the offload)")


def check_placement(config: Dict[str, Any], comm: Any, device: torch.device) -> None:
    """ValueError naming ``onebit_placement`` when "host" cannot run here: the 1-bit exchange
    then gets host buffers, which an NCCL communicator refuses even with one rank; MPI, the local
    communicator and a torch gloo group take them."""
    if config.get("onebit_placement") != "host" or device.type == "cpu":
        return
    name = comm.backend_name() if hasattr(comm, "backend_name") else type(comm).__name__
    if name not in ("mpi", "local", "torch:gloo"):
        raise ValueError(f"ZeroOptimizer: onebit_placement='host' needs a communicator that "
                         f"takes host buffers (MPI, gloo or local), got {name!r} with "
                         f"{comm.size()} ranks")


def step_inner(opt: torch.optim.Optimizer, groups: List[GroupLayout], onebit: Any,
               offload: Optional["HostOffload"]) -> Optional[List[torch.Tensor]]:
    """ZeroOptimizer's update of the master shards by its wrapped optimizer ``opt``: with
    ``onebit`` (the 1-bit optimizer's ``rules.RULES`` entry; None for a torch optimizer) the rule
    alone through ``step_on`` (it never talks on the shards), else ``opt.step()``; with
    ``offload`` on the host shards (:meth:`HostOffload.step`, whose new shards it returns)."""

    def rule() -> None:
        masters = [grp.master for grp in groups if grp.master.grad is not None]
        opt.step_on(masters, [m.grad for m in masters], opt.schedule.next_kind())

    if offload is not None:
        return offload.step(opt, groups, rule if onebit is not None else None)
    (rule if onebit is not None else opt.step)()
    return None


def _has_step_hooks(opt: torch.optim.Optimizer) -> bool:
    """Whether hooks of ``opt.step`` (``register_step_pre/post_hook``, or the global ones) exist."""
    from torch.optim import optimizer as o

    return any(bool(getattr(x, name, None)) for x, name in (
        (opt, "_optimizer_step_pre_hooks"), (opt, "_optimizer_step_post_hooks"),
        (o, "_global_optimizer_pre_hooks"), (o, "_global_optimizer_post_hooks")))


def _kernel_groups(opt: torch.optim.Optimizer) -> bool:
    """Whether the C++ CPU Adam can run ``opt``'s step: torch's Adam/AdamW without options the
    kernels do not have."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    if _has_step_hooks(opt):  # torch's own step() runs them
        return False
    for g in opt.param_groups:
        if any(g.get(k) for k in ("amsgrad", "maximize", "capturable", "differentiable", "fused")):
            return False
        if isinstance(g["lr"], torch.Tensor) or any(isinstance(b, torch.Tensor)
                                                    for b in g["betas"]):
            return False
    return True


class HostOffload:
    """Host-side master shards, optimizer state and gradient shards (see the module docstring).

    Parameters
    ----------
    optimizer_config, param_config : dict or None
        The validated ``offload_optimizer`` / ``offload_param`` dicts (None: not offloaded).
    stage : {1, 2, 3}
    device : torch.device
        Where the parameters (and the collectives' buffers) are.
    """

    def __init__(self, optimizer_config: Optional[Dict[str, Any]],
                 param_config: Optional[Dict[str, Any]], stage: int,
                 device: torch.device) -> None:
        self.optimizer = optimizer_config is not None
        self.param = param_config is not None
        self.stage = stage
        self.device = device
        self.cuda = device.type == "cuda"
        # pinned memory only helps (and only exists) with a GPU on the other side; each section
        # pins its own buffers (the optimizer's: master, gradient and copies; offload_param's shard)
        gpu = self.cuda and torch.cuda.is_available()
        self.pin_optimizer = bool(gpu and optimizer_config and optimizer_config["pin_memory"])
        self.pin_param = bool(gpu and param_config and param_config["pin_memory"])
        self.down = torch.cuda.Stream(device) if self.cuda else None  # gradient copies
        self.up = torch.cuda.Stream(device) if self.cuda else None  # parameter uploads
        self._uploaded: Optional[Any] = None  # event: the last uploads have read the host buffers
        self._pending: List[Tuple[Any, torch.Tensor, torch.Tensor]] = []  # (event, tmp, dst)
        self._pool: Dict[tuple, List[torch.Tensor]] = {}  # (numel, dtype) -> free host buffers
        self._grad: List[Optional[torch.Tensor]] = []  # stage 1: the host gradient shards
        self._out: List[Optional[torch.Tensor]] = []  # host parameter-dtype copies (bf16/fp16)
        self._pieces: List[List[Tuple[int, int]]] = []
        #: optimizer steps taken by the C++ kernels (the rest: the wrapped optimizer's step())
        self.kernel_steps = 0

    @classmethod
    def create(cls, config: Dict[str, Any], stage: int,
               device: torch.device) -> Optional["HostOffload"]:
        """The offload of a validated ``zero_optimization`` config; None if nothing is offloaded."""
        if config["offload_optimizer"] is None and config["offload_param"] is None:
            return None
        return cls(config["offload_optimizer"], config["offload_param"], stage, device)

    # ---- host memory ---------------------------------------------------------------------------

    def empty(self, numel: int, dtype: torch.dtype, pin: Optional[bool] = None) -> torch.Tensor:
        """A host tensor, pinned if ``pin`` (default: if the optimizer's buffers are)."""
        return torch.empty(numel, dtype=dtype,
                           pin_memory=self.pin_optimizer if pin is None else pin)

    def host_copy(self, t: torch.Tensor, dtype: Optional[torch.dtype] = None,
                  pin: Optional[bool] = None) -> torch.Tensor:
        """``t`` copied (and cast to ``dtype``) into a new host tensor (``pin``: as ``empty``)."""
        out = self.empty(t.numel(), dtype or t.dtype, pin)
        out.copy_(t.reshape(-1))
        return out

    def place(self, grp: GroupLayout, shard: torch.Tensor) -> None:
        """Give ``grp`` its fp32 master (and gradient) shard from its parameter shard ``shard``:
        in host memory when the optimizer is offloaded; the parameter shard itself too (stage 3
        with ``offload_param``). Called by :func:`.layout.partition` instead of allocating them
        on the device."""
        if self.optimizer:
            grp.master = self.host_copy(shard, torch.float32)
            grad = self.empty(grp.master.numel(), torch.float32).zero_()
            if self.stage >= 2:
                grp.master.grad = grad
            self._grad.append(None if self.stage >= 2 else grad)
            self._out.append(self.empty(grp.master.numel(), grp.dtype)
                             if grp.dtype != torch.float32 else None)
            self._pieces.append(_pieces(grp))
        else:
            grp.master = shard.to(torch.float32, copy=True)
            grp.master.grad = torch.zeros_like(grp.master) if self.stage >= 2 else None
        if self.param and self.stage == 3:
            shard = self.host_copy(shard, pin=self.pin_param)
        grp.param_shard = shard

    # ---- gradients: device chunks -> host shard --------------------------------------------------

    def receive(self, gi: int, grp: GroupLayout, bi: int, chunk: torch.Tensor,
                lo: int = 0) -> None:
        """Bucket ``bi``'s reduced chunk (on the device; from element ``lo`` of the rank's chunk
        when the bucket is reduced in pieces) is to be added into the host gradient shard:
        copied to a host buffer now (asynchronously on a GPU), added by :meth:`drain`."""
        if grp.master.grad is None:  # stage 1: the persistent host shard, zeroed per step
            grp.master.grad = self._grad[gi].zero_()
        dst = grp.buckets[bi].shard_of(grp.master.grad)[lo : lo + chunk.numel()]
        pool = self._pool.setdefault((chunk.numel(), chunk.dtype), [])
        tmp = pool.pop() if pool else self.empty(chunk.numel(), chunk.dtype)
        event = None
        if self.down is not None:
            self.down.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.down):
                tmp.copy_(chunk, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.down)
            chunk.record_stream(self.down)  # its memory is not reused before the copy is done
        else:
            tmp.copy_(chunk)
        self._pending.append((event, tmp, dst))
        self._retire(block=False)  # the host adds of finished copies overlap backward too

    def drain(self) -> None:
        """Wait for the gradient copies and add them into the host gradient shards."""
        self._retire(block=True)

    def _retire(self, block: bool) -> None:
        """Add the finished copies (in order: each slice sums its micro-steps in turn); with
        ``block``, all of them."""
        done = 0
        for event, tmp, dst in self._pending:
            if event is not None:
                if not block and not event.query():
                    break
                event.synchronize()
            dst.add_(tmp)
            self._pool[(tmp.numel(), tmp.dtype)].append(tmp)
            done += 1
        del self._pending[:done]

    # ---- the step ------------------------------------------------------------------------------

    def step(self, opt: torch.optim.Optimizer, groups: List[GroupLayout],
             update: Optional[Callable[[], Any]] = None) -> List[torch.Tensor]:
        """Step ``opt`` on the host shards; returns each group's new shard in the parameter
        dtype on the device (being uploaded on the current stream's behalf). ``update`` replaces
        ``opt.step()`` (a 1-bit optimizer's ``step_on`` on the host masters: its own ``step()``
        would talk on the world communicator)."""
        self.drain()
        if self._uploaded is not None:  # the last uploads still read the host buffers
            self._uploaded.synchronize()
            self._uploaded = None
        dev = [self._target(g) for g in groups]
        if self.up is not None:
            self.up.wait_stream(torch.cuda.current_stream(self.device))
        if update is None and _kernel_groups(opt):
            self._kernel_step(opt, groups, dev)
            self.kernel_steps += 1
            if getattr(opt.step, "_wrapped_by_lr_sched", False):
                opt._opt_called = True  # what the scheduler's wrapper of opt.step() would record
        else:
            (update or opt.step)()
            for gi, grp in enumerate(groups):
                src = self._host_param(gi, grp)
                if src is not grp.master:
                    src.copy_(grp.master)
                for lo, hi in self._pieces[gi]:
                    self._upload(dev[gi], src, lo, hi)
        out = [self._host_param(gi, grp) if d is None else d
               for gi, (grp, d) in enumerate(zip(groups, dev))]
        if self.up is not None:
            self._uploaded = torch.cuda.Event()
            self._uploaded.record(self.up)
            torch.cuda.current_stream(self.device).wait_stream(self.up)
        return out

    def _target(self, grp: GroupLayout) -> Optional[torch.Tensor]:
        """Where a group's new parameter shard is uploaded (None: no upload, the host copy is
        the result): stage 3, the device parameter shard itself; stage 1/2 with one rank, the
        flat parameters (the shard is the whole layout: no second copy on the device), else a
        new device shard for the all-gather."""
        if not self.cuda:
            return None
        if grp.flat is None:
            return grp.param_shard if grp.param_shard.device.type == "cuda" else None
        if grp.flat.numel() == grp.master.numel():
            return grp.flat
        return torch.empty(grp.master.numel(), dtype=grp.dtype, device=self.device)

    def _host_param(self, gi: int, grp: GroupLayout) -> torch.Tensor:
        out = self._out[gi]
        return grp.master if out is None else out

    def _upload(self, dst: Optional[torch.Tensor], src: torch.Tensor, lo: int, hi: int) -> None:
        if dst is not None:
            with torch.cuda.stream(self.up):
                dst[lo:hi].copy_(src[lo:hi], non_blocking=True)

    @torch.no_grad()
    def _kernel_step(self, opt: torch.optim.Optimizer, groups: List[GroupLayout],
                     dev: List[Optional[torch.Tensor]]) -> None:
        for gi, (grp, group) in enumerate(zip(groups, opt.param_groups)):
            w = grp.master
            g, out = w.grad, self._out[gi]
            if g is None:  # no gradient: nothing changes, but the upload must still happen
                for lo, hi in self._pieces[gi]:
                    if out is not None:
                        out[lo:hi].copy_(w[lo:hi])
                    self._upload(dev[gi], self._host_param(gi, grp), lo, hi)
                continue
            state = opt.state[w]
            if not state:  # torch's own initial state, so that state_dict() is torch's
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(w, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(w, memory_format=torch.preserve_format)
            for k in ("exp_avg", "exp_avg_sq"):
                if not state[k].is_contiguous():
                    state[k] = state[k].contiguous()
            state["step"] += 1
            step = int(state["step"].item())
            adamw = bool(group.get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW)))
            m, v = state["exp_avg"], state["exp_avg_sq"]
            for lo, hi in self._pieces[gi]:
                cpu_adam.adam_step_(w[lo:hi], m[lo:hi], v[lo:hi], g[lo:hi], group, step,
                                    adamw_mode=adamw,
                                    param_out=None if out is None else out[lo:hi])
                self._upload(dev[gi], self._host_param(gi, grp), lo, hi)

    # ---- introspection -------------------------------------------------------------------------

    def nbytes(self) -> int:
        """Bytes of this offload's own host buffers (gradient copies, parameter-dtype copies)."""
        total = sum(t.numel() * t.element_size() for pool in self._pool.values() for t in pool)
        total += sum(e[1].numel() * e[1].element_size() for e in self._pending)
        return total + sum(t.numel() * t.element_size() for t in self._out if t is not None)

    def idle_grad_bytes(self, groups: List[GroupLayout]) -> int:
        """Stage 1: bytes of the host gradient shards not attached to a master right now."""
        return sum(t.numel() * 4 for t, grp in zip(self._grad, groups)
                   if t is not None and grp.master.grad is not t)


def _pieces(grp: GroupLayout) -> List[Tuple[int, int]]:
    """The shard cut into ranges of whole buckets of about :data:`PIECE` elements."""
    out: List[Tuple[int, int]] = []
    lo = hi = 0
    for b in grp.buckets:
        hi = b.shard_offset + b.chunk
        if hi - lo >= PIECE:
            out.append((lo, hi))
            lo = hi
    if hi > lo:
        out.append((lo, hi))
    return out
