"""One checkpoint file per rank for the 1-bit optimizers, and the check of a state dict before
it is loaded (:func:`validate_state_dict`, also what ZeroOptimizer runs on its wrapped
optimizer's state)."""

from __future__ import annotations

import os

from .._checkpoint import atomic_save, read_checkpoint
from ._state import LoadPlan, validate_state_dict
from .base import OneBitBase

__all__ = ["save_rank_checkpoint", "load_rank_checkpoint", "validate_state_dict", "LoadPlan"]


def save_rank_checkpoint(optimizer: OneBitBase, directory: str) -> str:
    """Write this rank's ``optimizer.state_dict()`` to ``directory/optim_rank{r}_of{W}.pt``.

    For exact resume (``exact_resume=True``) every rank must save its own file: error buffers,
    and in ZeroOneAdam's local steps even the momentum, differ per rank.

    The file is written atomically (a temporary file, fsynced, then renamed over the old one): a
    process killed while saving leaves the previous checkpoint loadable.

    Returns
    -------
    str
        The path written.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"optim_rank{optimizer.rank}_of{optimizer.world_size}.pt")
    atomic_save(optimizer.state_dict(), path)
    return path


def load_rank_checkpoint(optimizer: OneBitBase, directory: str) -> str:
    """Load what :func:`save_rank_checkpoint` wrote for this rank.

    If there is no file for this rank and world size (the world size changed), rank 0's file of
    another world size is loaded instead and the error buffers are reset with a warning (a
    directory holding rank-0 files of several other world sizes raises ValueError naming them).

    Returns
    -------
    str
        The path read.

    Raises
    ------
    FileNotFoundError
        No checkpoint in ``directory``.
    ValueError, TypeError
        The file is unreadable or its state malformed (named); the optimizer is left unchanged.
    """
    path = os.path.join(directory, f"optim_rank{optimizer.rank}_of{optimizer.world_size}.pt")
    if not os.path.exists(path):
        cands = sorted(f for f in os.listdir(directory)
                       if f.startswith("optim_rank0_of") and f.endswith(".pt"))
        if not cands:
            raise FileNotFoundError(f"directory: no optimizer checkpoint in {directory!r}")
        if len(cands) > 1:  # runs of several world sizes: which one is newest is not ours to guess
            raise ValueError(f"directory: {directory!r} has no {os.path.basename(path)} and holds "
                             f"rank-0 checkpoints of several world sizes ({', '.join(cands)}); "
                             "remove the stale ones or load one with load_state_dict")
        path = os.path.join(directory, cands[0])
    optimizer.load_state_dict(read_checkpoint(path))
    return path
