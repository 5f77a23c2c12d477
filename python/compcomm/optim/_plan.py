"""The bucket plan of the 1-bit optimizers' compressed average (a mixin of
:class:`compcomm.optim.base.OneBitBase`): which parameters share a bucket, kept while the same
parameters communicate; a new plan restarts the error buffers, and a step that fails after
making one puts the old plan and buffers back."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..collectives import padded_numel
from ..compress import plan_buckets

__all__ = ["BucketPlans"]


class BucketPlans:
    """Plan state (``_plan_key``, ``_buckets``, ``_staging``, ``_plan_desc``, ``_staged``,
    ``_loaded_errors``) over the optimizer's ``param_groups``, ``compressor``,
    ``per_parameter`` and ``reduce_bucket_size``."""

    def _bucket_plan(self, items: List[Tuple[Dict[str, Any], torch.Tensor]],
                     key: Optional[Tuple[Any, ...]] = None) -> List[List[int]]:
        """Buckets (indices into ``items``) for the compressed average of ``items``' tensors.
        The plan is kept while the same parameters communicate; when they change (a parameter
        without gradient), the error buffers restart at zero, as their layout no longer fits.
        """
        key = self._plan_key_of(items) if key is None else key
        if key != self._plan_key:
            limit = 0 if self.per_parameter else self.reduce_bucket_size
            self._buckets = plan_buckets([((gi, p.device), p.numel())
                                          for (gi, _), (_, p) in zip(key, items)], limit)
            self._staging = {}
            if self.compressor.keys():
                warnings.warn(f"{self._name}: the parameters with gradients changed, so the "
                              "compression buckets did: error buffers restart at zero (give every "
                              "parameter a gradient, e.g. zeros, to keep them)", RuntimeWarning,
                              stacklevel=4)
            self.compressor.reset()
            self._plan_key = key
            self._plan_desc = self._plan_description(items)
            self._restore_loaded_errors(items)
        return self._buckets

    def _plan_key_of(self, items: List[Tuple[Dict[str, Any], torch.Tensor]]) -> Tuple[Any, ...]:
        gidx = {id(g): gi for gi, g in enumerate(self.param_groups)}
        return tuple((gidx[id(g)], id(p)) for g, p in items)

    def _plan_undo(self, key: Tuple[Any, ...]) -> Optional[Callable[[], None]]:
        """Where the items of ``key`` (:meth:`_plan_key_of`) change the bucket plan (which resets
        the error buffers): a function that puts the current plan and error buffers back, for a
        step that then fails (it is skipped, and a skipped step leaves the errors as they were).
        None where the plan stays."""
        if key == self._plan_key:
            return None
        kept = (self._plan_key, self._buckets, self._staging, self._plan_desc,
                getattr(self, "_staged", None), self._loaded_errors)
        errors = self.compressor.state_dict()  # copies: reset() drops the buffers

        def undo() -> None:
            (self._plan_key, self._buckets, self._staging, self._plan_desc, self._staged,
             self._loaded_errors) = kept
            self.compressor.reset()
            self.compressor.load_state_dict(errors)
        return undo

    def _plan_description(self, items: List[Tuple[Dict[str, Any], torch.Tensor]]
                          ) -> List[List[Tuple[int, int]]]:
        """The bucket plan as (group index, index in group) pairs (what checkpoints record)."""
        where = {id(p): (gi, pi) for gi, g in enumerate(self.param_groups)
                 for pi, p in enumerate(g["params"])}
        return [[where[id(items[j][1])] for j in b] for b in self._buckets]

    def _restore_loaded_errors(self, items: List[Tuple[Dict[str, Any], torch.Tensor]]) -> None:
        if self._loaded_errors is None:
            return
        plan, errors = self._loaded_errors
        self._loaded_errors = None
        world = self.compressor.comm.size()
        wrong = [k for k, b in enumerate(self._buckets) if k in errors and
                 errors[k]["worker_error"].numel()
                 != padded_numel(sum(items[j][1].numel() for j in b), world)]
        if plan == self._plan_desc and not wrong:
            self.compressor.load_state_dict(errors)
        elif plan == self._plan_desc:  # (the compressor would replace them by zeros, silently)
            warnings.warn(f"{self._name}: the checkpoint's error buffers of bucket(s) {wrong} are "
                          "not of their buckets' sizes: error buffers reset to zero",
                          RuntimeWarning, stacklevel=4)
        else:
            warnings.warn(f"{self._name}: the checkpoint's compression buckets differ from this "
                          "optimizer's (bucket size, per_parameter or parameters with gradients "
                          "changed): error buffers reset to zero", RuntimeWarning, stacklevel=4)
