"""compcomm: 1-bit compressed collectives with error feedback for PyTorch.

The core (C++, with CUDA kernels when built with a CUDA toolkit) implements DeepSpeed's 1-bit
compressed allreduce once, against a backend interface; any ``torch.distributed`` process group
(gloo, nccl) can carry it, and a world of one rank needs no process group at all.

>>> import torch, compcomm
>>> m = torch.randn(1000)
>>> we, se = compcomm.error_buffers(m)
>>> _ = compcomm.compressed_allreduce(m, we, se)   # world of one rank: m becomes its 1-bit form
"""

from __future__ import annotations

from typing import Any, Dict, List

from . import _C, errors
from ._comm import TorchCommunicator, resolve as get_communicator
from ._init import init, shutdown
from .ddp import ddp_comm_hook
from .collectives import (
    DEFAULT_TIMEOUT,
    allreduce_wire_bytes,
    compressed_allreduce,
    error_buffers,
    padded_numel,
    wire_bytes,
)
from .config import from_config

__version__ = _C.build_info()["version"]

__all__ = [
    "init",
    "shutdown",
    "compressed_allreduce",
    "ddp_comm_hook",
    "error_buffers",
    "padded_numel",
    "wire_bytes",
    "allreduce_wire_bytes",
    "build_info",
    "available_backends",
    "get_communicator",
    "TorchCommunicator",
    "LocalCommunicator",
    "Communicator",
    "errors",
    "DEFAULT_TIMEOUT",
    "from_config",
    "__version__",
]

Communicator = _C.Communicator
LocalCommunicator = _C.LocalCommunicator


def build_info() -> Dict[str, Any]:
    """What this build of compcomm contains.

    Returns
    -------
    dict
        ``cuda``, ``nccl``, ``mpi`` (bool: compiled in), ``cuda_version``, ``nccl_version``,
        ``mpi_version`` (str or None), ``version``, ``compiler``, plus at run time ``torch_version``
        and ``cuda_devices`` (CUDA devices visible now).
    """
    import torch

    info = dict(_C.build_info())
    info["torch_version"] = torch.__version__
    info["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return info


def available_backends() -> List[str]:
    """Backends usable in this process: ``"local"`` always; ``"torch"`` when torch.distributed is
    available; ``"mpi"`` and ``"nccl"`` when compiled in (and, for nccl, a GPU is visible)."""
    import torch
    import torch.distributed as dist

    info = build_info()
    names = ["local"]
    if dist.is_available():
        names.append("torch")
    if info["mpi"]:
        names.append("mpi")
    if info["nccl"] and torch.cuda.is_available():
        names.append("nccl")
    return names
