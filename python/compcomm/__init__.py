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

from . import _C, errors
from ._comm import TorchCommunicator, resolve as get_communicator
from ._init import available_backends, build_info, init, make_communicator, shutdown
from .ddp import ddp_comm_hook
from .collectives import (
    DEFAULT_TIMEOUT,
    allreduce_wire_bytes,
    compressed_allreduce,
    compressed_reduce_scatter,
    error_buffers,
    padded_numel,
    wire_bytes,
)
from .config import from_config

__version__ = _C.build_info()["version"]

__all__ = [
    "init",
    "shutdown",
    "make_communicator",
    "compressed_allreduce",
    "compressed_reduce_scatter",
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
