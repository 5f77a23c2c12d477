"""Loss scaling for fp16 training, as DeepSpeed's ``fp16`` section does it (hysteresis 1).

:class:`LossScaler` is the one scaler of compcomm: ZeroOptimizer multiplies the loss by
:attr:`LossScaler.scale` in ``backward`` and tells the scaler after each step whether the gradient
was finite. The 1-bit optimizers, used without ZeRO, take torch's ``GradScaler`` protocol instead
(``grad_scale`` / ``found_inf``), so they keep no scaler of their own.
"""

from __future__ import annotations

import torch

__all__ = ["LossScaler"]


class LossScaler:
    """Static or dynamic loss scale.

    Parameters
    ----------
    loss_scale : float
        > 0: a static scale; 0: dynamic, starting at ``2 ** initial_scale_power``.
    initial_scale_power : int
    window : int
        Dynamic: finite steps in a row after which the scale doubles (``loss_scale_window``).
    min_scale : float
        Dynamic: the scale never halves below this (``min_loss_scale``).
    """

    def __init__(self, loss_scale: float = 1.0, initial_scale_power: int = 16,
                 window: int = 1000, min_scale: float = 1.0) -> None:
        if loss_scale < 0:
            raise ValueError(f"loss_scale must be >= 0 (0: dynamic), got {loss_scale}")
        if int(window) < 1:  # the scale doubles every `window` finite steps
            raise ValueError(f"loss_scale_window must be >= 1, got {window}")
        if not min_scale > 0:
            raise ValueError(f"min_loss_scale must be > 0, got {min_scale}")
        self.dynamic = loss_scale == 0
        #: the factor the loss is multiplied by now
        self.scale = float(2**initial_scale_power) if self.dynamic else float(loss_scale)
        self.window = int(window)
        self.min_scale = float(min_scale)
        self._good_steps = 0

    @property
    def good_steps(self) -> int:
        """Finite steps in a row since the last overflow (the scale doubles when it reaches a
        multiple of ``window``); ZeRO checkpoints save it, so a resumed run doubles on time."""
        return self._good_steps

    @good_steps.setter
    def good_steps(self, value: int) -> None:
        self._good_steps = int(value)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (``loss`` itself when the scale is 1)."""
        return loss * self.scale if self.scale != 1.0 else loss

    def update(self, finite: bool) -> None:
        """After a step: a non-finite gradient halves a dynamic scale (down to ``min_scale``); the
        ``window``-th finite step in a row doubles it."""
        if not self.dynamic:
            return
        if not finite:
            self.scale = max(self.scale / 2, self.min_scale)
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps % self.window == 0:
            self.scale *= 2
