"""Drop-in 1-bit optimizers: DeepSpeed's 1-bit Adam, 0/1 Adam and 1-bit LAMB without DeepSpeed.

>>> import torch
>>> from compcomm.optim import OneBitAdam
>>> model = torch.nn.Linear(4, 2)
>>> opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=100)

Replace ``torch.optim.Adam`` in a torchrun/mpirun script; the optimizer averages gradients itself
(do not wrap the model in DDP, or use :func:`compcomm.ddp_comm_hook`). See docs/optimizers.md.
"""

from .adam import OneBitAdam
from .checkpoint import load_rank_checkpoint, save_rank_checkpoint
from .cpu_adam import CPUAdam
from .lamb import OneBitLamb
from .zoadam import ZeroOneAdam

__all__ = ["OneBitAdam", "ZeroOneAdam", "OneBitLamb", "CPUAdam", "save_rank_checkpoint",
           "load_rank_checkpoint"]
