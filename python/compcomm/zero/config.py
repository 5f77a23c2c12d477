"""DeepSpeed's ``zero_optimization`` keys: defaults, validation, and which ones compcomm supports."""

from __future__ import annotations

import sys
from typing import Any, Dict

__all__ = ["ZERO_DEFAULTS", "OFFLOAD_REDUCE_BUCKET_SIZE", "validate_zero_config",
           "check_arguments"]

# DeepSpeed's defaults (runtime/zero/config.py). Sizes are element counts.
ZERO_DEFAULTS: Dict[str, Any] = {
    "stage": 0,
    "reduce_bucket_size": int(5e8),
    "allgather_bucket_size": int(5e8),
    "overlap_comm": None,  # resolves to True for stage 3, False otherwise
    "contiguous_gradients": True,
    "reduce_scatter": True,
    "use_multi_rank_bucket_allreduce": True,
    "allgather_partitions": True,
    "round_robin_gradients": False,
    "sub_group_size": int(1e9),
    "stage3_prefetch_bucket_size": int(5e7),
    "stage3_param_persistence_threshold": int(1e5),
    "stage3_model_persistence_threshold": sys.maxsize,
    "stage3_max_live_parameters": int(1e9),
    "stage3_max_reuse_distance": int(1e9),
    "stage3_gather_16bit_weights_on_model_save": False,
    "offload_optimizer": None,
    "offload_param": None,
    "elastic_checkpoint": False,
    # compcomm's own key: ZeRO + OneBitAdam's compressed phase, "exact" (None), "no_allgather" or
    # "sharded" (see docs/zero.md); validated by ZeroOptimizer, which knows the optimizer
    "onebit_mode": None,
    # compcomm's own key: with offload_optimizer, where OneBitAdam's 1-bit work on a bucket runs,
    # "device" (None) or "host" (see docs/zero.md, Offload)
    "onebit_placement": None,
}

#: ``reduce_bucket_size`` with ``offload_optimizer`` when none is given: DeepSpeed's 5e8 would
#: stage up to three 5e8-element buckets on the device, more than the parameters of most models
#: that need offload; 1e7 elements bound the staging at about 60 MB (bf16) and keep each
#: device-to-host copy long enough to run near PCIe bandwidth.
OFFLOAD_REDUCE_BUCKET_SIZE = int(1e7)

# Keys accepted only with a value that compcomm implements; anything else is rejected by name.
_ONLY = {
    "reduce_scatter": (True,),  # compcomm always reduce-scatters (the allreduce path is not provided)
    "allgather_partitions": (True,),  # all-gather is the only way partitions are re-assembled
    "round_robin_gradients": (False,),  # DeepSpeed's offload copy-order tweak: not implemented
    "elastic_checkpoint": (False,),
    "stage3_gather_16bit_weights_on_model_save": (False,),
}

_SIZE_KEYS = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "sub_group_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
)


# DeepSpeed's offload keys (runtime/zero/offload_config.py) with their defaults. Keys that only
# configure NVMe (swap buffers, AIO pipelining) are accepted and ignored, as DeepSpeed ignores them
# for device "cpu"; ``ratio`` (partial offload) is accepted only as 1.0.
_OFFLOAD_KEYS: Dict[str, Dict[str, Any]] = {
    "offload_optimizer": {"device": "none", "nvme_path": None, "buffer_count": 4,
                          "pin_memory": False, "pipeline": False, "pipeline_read": False,
                          "pipeline_write": False, "fast_init": False, "ratio": 1.0},
    "offload_param": {"device": "none", "nvme_path": None, "buffer_count": 5,
                      "buffer_size": int(1e8), "max_in_cpu": int(1e9), "pin_memory": False},
}


def _offload(key: str, v: Any, stage: int, where: str) -> Any:
    """One offload dict checked: None (off) or the dict with DeepSpeed's defaults filled in."""
    name = f"{where}.{key}"
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError(f"{name} must be an object such as {{\"device\": \"cpu\"}}, got {v!r}")
    out = dict(_OFFLOAD_KEYS[key])
    for k, x in v.items():
        if k not in out:
            raise ValueError(f"{name}.{k}: unknown offload key (known keys: {', '.join(sorted(out))})")
        out[k] = x
    device = out["device"]
    if device in (None, "none"):
        return None
    if device == "nvme":
        raise ValueError(f"{name}.device='nvme': NVMe offload is not supported by compcomm "
                         "(use device 'cpu')")
    if device != "cpu":
        raise ValueError(f"{name}.device must be 'cpu' or 'none', got {device!r}")
    for k in ("pin_memory", "pipeline", "pipeline_read", "pipeline_write", "fast_init"):
        if k in out and not isinstance(out[k], bool):
            raise ValueError(f"{name}.{k} must be true or false, got {out[k]!r}")
    if out.get("ratio", 1.0) != 1.0:
        raise ValueError(f"{name}.ratio={out['ratio']!r}: partial offload is not supported by "
                         "compcomm (only 1.0: all of the optimizer state on the CPU)")
    if key == "offload_param" and stage in (1, 2):
        raise ValueError(f"{name}: parameter offload needs stage 3, got stage {stage}")
    if stage == 0:
        raise ValueError(f"{name}: offload needs ZeRO stage 1, 2 or 3 (stage is 0)")
    return out


def validate_zero_config(cfg: Dict[str, Any], where: str = "zero_optimization") -> Dict[str, Any]:
    """Fill DeepSpeed's defaults into a ``zero_optimization`` dict and check every key.

    Parameters
    ----------
    cfg : dict
        Keys as in DeepSpeed's ``zero_optimization`` section.
    where : str
        Prefix for error messages (the config path of ``cfg``).

    Returns
    -------
    dict
        A new dict with every key of :data:`ZERO_DEFAULTS` set; ``overlap_comm`` resolved;
        ``reduce_bucket_size`` :data:`OFFLOAD_REDUCE_BUCKET_SIZE` if ``offload_optimizer`` is on
        and it is not given.

    Raises
    ------
    ValueError
        For an unknown key, a value of the wrong type, or a setting compcomm does not implement
        (NVMe offload, ``reduce_scatter=False``, ...); the message names the key. The offload
        dicts come back with DeepSpeed's defaults filled in, or None when off.
    """
    out = dict(ZERO_DEFAULTS)
    for key, value in cfg.items():
        if key not in ZERO_DEFAULTS:
            raise ValueError(
                f"{where}.{key}: unknown ZeRO key (known keys: {', '.join(sorted(ZERO_DEFAULTS))})"
            )
        out[key] = value
    stage = out["stage"]
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"{where}.stage must be 0, 1, 2 or 3 (an integer), got {stage!r}")
    for key in _SIZE_KEYS:
        v = out[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or int(v) != v:
            raise ValueError(f"{where}.{key} must be a non-negative whole number of elements, got {v!r}")
        out[key] = int(v)
    if out["allgather_bucket_size"] % 2:
        raise ValueError(
            f"{where}.allgather_bucket_size must be a multiple of 2 (as in DeepSpeed), "
            f"got {out['allgather_bucket_size']}"
        )
    if out["reduce_bucket_size"] == 0:
        raise ValueError(f"{where}.reduce_bucket_size must be > 0")
    for key in ("overlap_comm", "contiguous_gradients", "use_multi_rank_bucket_allreduce"):
        v = out[key]
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"{where}.{key} must be true or false, got {v!r}")
    for key, allowed in _ONLY.items():
        if out[key] not in allowed:
            raise ValueError(
                f"{where}.{key}={out[key]!r} is not supported by compcomm (only {allowed[0]!r})"
            )
    for key in ("offload_optimizer", "offload_param"):
        out[key] = _offload(key, out[key], stage, where)
    if out["offload_optimizer"] is not None and "reduce_bucket_size" not in cfg:
        out["reduce_bucket_size"] = OFFLOAD_REDUCE_BUCKET_SIZE
    if out["onebit_mode"] not in (None, "exact", "no_allgather", "sharded"):
        raise ValueError(f"{where}.onebit_mode must be 'exact', 'no_allgather' or 'sharded', "
                         f"got {out['onebit_mode']!r}")
    if out["onebit_placement"] not in (None, "device", "host"):
        raise ValueError(f"{where}.onebit_placement must be 'device' or 'host', "
                         f"got {out['onebit_placement']!r}")
    if out["onebit_placement"] == "host" and out["offload_optimizer"] is None:
        raise ValueError(f"{where}.onebit_placement='host' needs offload_optimizer (without "
                         "offload the 1-bit work stays where the gradients are)")
    if out["overlap_comm"] is None:
        out["overlap_comm"] = stage == 3
    return out


def check_arguments(stage: Any, zero_config: Dict[str, Any], module: Any, gas: Any, clip: float,
                    loss_scale: float) -> Dict[str, Any]:
    """ZeroOptimizer's arguments checked (ValueError naming the argument): returns its validated
    ``zero_optimization`` keys, ``stage`` included."""
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3 (an integer), got {stage!r}")
    if "stage" in zero_config and zero_config["stage"] != stage:
        raise ValueError(f"stage={stage} contradicts zero_config stage={zero_config['stage']}")
    config = validate_zero_config(dict(zero_config, stage=stage), where="ZeroOptimizer")
    if stage == 3 and module is None:
        raise ValueError("module: stage 3 needs the model (module=...) to install its hooks")
    if int(gas) < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gas}")
    if clip < 0:
        raise ValueError(f"gradient_clipping must be >= 0, got {clip}")
    if loss_scale < 0:
        raise ValueError(f"loss_scale must be >= 0 (0: dynamic), got {loss_scale}")
    return config
