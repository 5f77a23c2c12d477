"""Checkpoint plumbing shared by the 1-bit optimizers and ZeRO: atomic writes and validation.

A checkpoint load validates the whole state dict first (types, shapes, world size, schedule) and
only then replaces anything, so a failed load leaves the optimizer as it was. A checkpoint save
writes a temporary file next to the target, fsyncs it and renames it over the target: a process
killed while saving leaves the previous checkpoint whole.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

#: Per-parameter state entries that must have the parameter's shape (torch's Adam/AdamW/SGD
#: names and compcomm's).
SHAPED_KEYS = (
    "exp_avg",
    "exp_avg_sq",
    "max_exp_avg_sq",
    "momentum_buffer",
    "master_param",
    "exp_avg_sq_fresh",
)
#: Hyper-parameters checked in each saved param group (when the optimizer's own groups have them).
_HPARAMS = ("lr", "betas", "eps", "weight_decay", "bias_correction")


class StateSpec(NamedTuple):
    """What one parameter's saved state must hold for the optimizer's step to run on it.

    Checked on load, so that a state the step would trip over is refused while the old state is
    still in place (a step would otherwise fail, or go NaN, after the load replaced it).
    """

    #: all or none of these keys (a parameter with none starts afresh at its first step)
    together: Tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    #: (key, keys that must be present whenever ``key`` is)
    needs: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()
    #: the shaped tensors (:data:`SHAPED_KEYS`) must be float32 (no cast on load)
    float32: bool = False
    #: (key, minimum, strict): when present, a finite number >= minimum (> if strict)
    scalars: Tuple[Tuple[str, float, bool], ...] = ()


def torch_adam_spec(group: Mapping) -> StateSpec:
    """The state torch's Adam/AdamW step needs for a parameter of ``group``: all of it or none
    (torch casts the moments to the parameter's dtype on load)."""
    keys = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
    return StateSpec(together=keys)


def _check_param_state(sw: str, st: Mapping, p: torch.Tensor, spec: StateSpec) -> None:
    """One parameter's state (``sw`` names it) against ``spec``; see :class:`StateSpec`."""
    present = [k for k in spec.together if k in st]
    if present and len(present) != len(spec.together):
        missing = [k for k in spec.together if k not in st]
        raise ValueError(f"{sw} has {present} but lacks {missing}")
    for key, deps in spec.needs:
        if key in st:
            for dep in deps:
                if dep not in st:
                    raise ValueError(f"{sw} has {key!r} but lacks {dep!r}")
    for key, v in st.items():
        if key in SHAPED_KEYS:
            need_tensor(f"{sw}[{key!r}]", v, shape=tuple(p.shape),
                        dtype=torch.float32 if spec.float32 else None)
    for key, minimum, strict in spec.scalars:
        if key not in st:
            continue
        v = st[key]
        if not is_real(v):
            raise TypeError(f"{sw}[{key!r}] must be a number, got {type(v).__name__} {v!r}")
        f = float(v)
        if not math.isfinite(f) or not (f > minimum if strict else f >= minimum):
            raise ValueError(f"{sw}[{key!r}] must be a finite number {'>' if strict else '>='} "
                             f"{minimum}, got {v!r}")


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save(obj, path)`` that never leaves a partly written ``path``.

    The bytes go to a hidden temporary file in the same directory, which is fsynced and then
    renamed over ``path`` (atomic on POSIX); the directory is fsynced so the rename survives a
    crash. If the process dies first, ``path`` still holds the previous checkpoint.
    """
    directory = os.path.dirname(os.path.abspath(path))
    # hidden and not ending in ".pt": directory scans for checkpoints never pick it up
    unique = f"{os.getpid()}.{threading.get_ident()}"
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{unique}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # not every file system lets a directory be fsynced
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def read_checkpoint(path: str, map_location: Any = None) -> Any:
    """``torch.load(path, map_location, weights_only=True)``; a file that exists but does not
    unpickle raises ValueError naming it (a missing file raises FileNotFoundError).

    ``weights_only=True``: unpickling runs no code from the file (a checkpoint may come from
    elsewhere); everything compcomm writes is tensors and plain containers, which load that way.
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # truncated or foreign files raise a zoo of unpickling errors
        raise ValueError(f"checkpoint file {path!r} is unreadable ({type(e).__name__}: {e})") from e


# --------------------------------------------------------------------------------------------
# small typed checks; ``where`` names the argument and the path inside it
# --------------------------------------------------------------------------------------------
def is_int(v: Any) -> bool:
    """True for an int that is not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v: Any) -> bool:
    """True for a real number (not a bool) or a one-element real tensor."""
    if isinstance(v, torch.Tensor):
        return v.numel() == 1 and not v.is_complex() and v.dtype != torch.bool
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def need_mapping(where: str, v: Any) -> Mapping:
    """``v`` if it is a dict-like, else TypeError naming ``where``."""
    if not isinstance(v, Mapping):
        raise TypeError(f"{where} must be a dict, got {type(v).__name__}")
    return v


def need_list(where: str, v: Any) -> Sequence:
    """``v`` if it is a list or tuple, else TypeError naming ``where``."""
    if not isinstance(v, (list, tuple)):
        raise TypeError(f"{where} must be a list, got {type(v).__name__}")
    return v


def need_int(where: str, v: Any, minimum: int = 0) -> int:
    """``v`` if it is an int >= ``minimum``, else TypeError/ValueError naming ``where``."""
    if not is_int(v):
        raise TypeError(f"{where} must be an integer, got {type(v).__name__} {v!r}")
    if v < minimum:
        raise ValueError(f"{where} must be >= {minimum}, got {v}")
    return int(v)


def need_tensor(
    where: str,
    v: Any,
    shape: Optional[tuple] = None,
    dtype: Optional[torch.dtype] = None,
    numel: Optional[int] = None,
) -> torch.Tensor:
    """``v`` if it is a floating tensor of the given shape/dtype/numel, else a typed error."""
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(v).__name__}")
    if dtype is not None and v.dtype != dtype:
        raise TypeError(f"{where} must be {dtype}, got {v.dtype}")
    if not v.is_floating_point():
        raise TypeError(f"{where} must be a floating-point tensor, got {v.dtype}")
    if shape is not None and tuple(v.shape) != tuple(shape):
        raise ValueError(f"{where} has shape {tuple(v.shape)}, expected {tuple(shape)}")
    if numel is not None and v.numel() != numel:
        raise ValueError(f"{where} has {v.numel()} elements, expected {numel}")
    return v


def _check_hparams(where: str, saved: Mapping, current: Mapping) -> None:
    for key in _HPARAMS:
        if key not in current:
            continue
        if key not in saved:
            raise ValueError(f"{where} lacks {key!r}")
        v = saved[key]
        if key == "bias_correction":
            if not isinstance(v, bool):
                raise TypeError(f"{where}[{key!r}] must be true or false, got {v!r}")
        elif key == "betas":
            if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(is_real(b) for b in v)):
                raise TypeError(f"{where}['betas'] must be two numbers, got {v!r}")
            if not all(0.0 <= float(b) < 1.0 for b in v):
                raise ValueError(f"{where}['betas'] must be in [0, 1), got {v!r}")
        else:
            if not is_real(v):
                raise TypeError(f"{where}[{key!r}] must be a number, got {type(v).__name__} {v!r}")
            if not float(v) >= 0.0:  # also rejects NaN
                raise ValueError(f"{where}[{key!r}] must be >= 0, got {v!r}")


def check_optimizer_state(
    where: str,
    sd: Any,
    params: List[List[torch.Tensor]],
    current_groups: List[Mapping],
    specs: Optional[Sequence[StateSpec]] = None,
) -> Dict[int, torch.Tensor]:
    """Validate a torch-style optimizer state dict against the parameters it will be loaded into.

    Parameters
    ----------
    where : str
        How messages name the state dict (for example ``"OneBitAdam.load_state_dict: state_dict"``).
    sd : object
        The candidate ``{"state": ..., "param_groups": [...]}``.
    params : list of list of torch.Tensor
        The parameters of each group the state will belong to.
    current_groups : list of dict
        The optimizer's own groups: each hyper-parameter they hold must be present and valid.
    specs : list of StateSpec, optional
        Per group, what each parameter's state must hold (default: :class:`StateSpec`'s).

    Returns
    -------
    dict
        Saved parameter id -> the parameter it maps to.

    Raises
    ------
    TypeError, ValueError
        Naming the first bad entry; nothing is modified.
    """
    sd = need_mapping(where, sd)
    for key in ("state", "param_groups"):
        if key not in sd:
            raise ValueError(f"{where} lacks the {key!r} entry")
    groups = need_list(f"{where}['param_groups']", sd["param_groups"])
    if len(groups) != len(params):
        raise ValueError(
            f"{where}['param_groups'] has {len(groups)} groups, this optimizer has {len(params)}"
        )
    id_map: Dict[int, torch.Tensor] = {}
    spec_of: Dict[int, StateSpec] = {}
    specs = list(specs) if specs is not None else [StateSpec()] * len(params)
    for gi, (g, ps, cur) in enumerate(zip(groups, params, current_groups)):
        gw = f"{where}['param_groups'][{gi}]"
        g = need_mapping(gw, g)
        ids = need_list(f"{gw}['params']", g.get("params"))
        if len(ids) != len(ps):
            raise ValueError(
                f"{gw}['params'] lists {len(ids)} parameters, this optimizer's group has {len(ps)}"
            )
        for pid, p in zip(ids, ps):
            if not is_int(pid) or pid in id_map:
                raise ValueError(f"{gw}['params'] must list distinct integer ids, got {pid!r}")
            id_map[int(pid)] = p
            spec_of[int(pid)] = specs[gi]
        _check_hparams(gw, g, cur)
    state = need_mapping(f"{where}['state']", sd["state"])
    for pid, st in state.items():
        sw = f"{where}['state'][{pid!r}]"
        if pid not in id_map:
            raise ValueError(f"{sw}: no parameter group lists parameter id {pid!r}")
        p = id_map[pid]
        st = need_mapping(sw, st)
        _check_param_state(sw, st, p, spec_of[pid])
        for key, v in st.items():
            if key == "step":
                if not is_real(v):
                    raise TypeError(f"{sw}['step'] must be a number, got {type(v).__name__} {v!r}")
                if not float(v) >= 0:
                    raise ValueError(f"{sw}['step'] must be >= 0, got {v!r}")
    return id_map
