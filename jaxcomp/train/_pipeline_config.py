"""``config.pipeline``'s defaults and the objects it describes: the links, the detector, the
replicas' gradient average.

The keys and their meaning are documented in :mod:`jaxcomp.train._pipeline_mode`; this module
reads them into :mod:`jaxcomp.pipeline` objects and raises a ``ValueError`` naming the key for a
value it cannot use.
"""

from __future__ import annotations

from typing import Any

from jaxcomp import _validate
from jaxcomp import comm
from jaxcomp import pipeline
from jaxcomp.train import _config
from jaxcomp.train import _dp_mode

PIPELINE_DEFAULTS = {
    "num_microbatches": 8,
    "forward": "identity",
    "backward": "identity",
    "backward_mode": "independent",
    "boundaries": None,
    "warmup_epochs": 0,
    "simulate": False,
    "schedule": "gpipe",
    "checkpoint": False,
    "replica_mean": None,
    "forward_high": None,
    "backward_high": None,
    "detector": None,
    "sync_batch_stats": False,
    "eval_batch_stats": "worker0",
}
DETECTOR_DEFAULTS = {"interval_epochs": None, "interval_steps": None, "check_every": 10, "eta": 0.5}

REPLICA_TRANSFORMS = ("compressed_mean", "accordion")  #: averages for config.pipeline.replica_mean


def links_of(cfg: dict, num_boundaries: int, num_samples: int) -> tuple[Any, ...]:
    """One ``pipeline.Link`` (or ``AdaptiveLink`` with ``*_high``) per boundary, from
    ``config.pipeline.boundaries`` or the shared ``forward`` / ``backward`` channels."""
    per = cfg["boundaries"]
    if per is None:
        per = [
            {k: cfg[k] for k in ("forward", "backward", "forward_high", "backward_high")}
        ] * num_boundaries
    per = [dict(b) for b in per]
    if len(per) != num_boundaries:
        raise ValueError(
            f"config.pipeline.boundaries has {len(per)} entries; the model has "
            f"{num_boundaries} boundaries."
        )
    out = []
    shared = cfg["backward_mode"] == "shared_mask"

    def channel(spec):
        return None if spec is None else _config.build_channel(spec, num_samples)

    for b in per:
        unknown = sorted(set(b) - {"forward", "backward", "forward_high", "backward_high"})
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in a config.pipeline.boundaries entry.")
        fwd = channel(b.get("forward", "identity"))
        bwd = None if shared else channel(b.get("backward", "identity"))
        fwd_hi, bwd_hi = channel(b.get("forward_high")), channel(b.get("backward_high"))
        if shared and bwd_hi is not None:
            raise ValueError(
                "config.pipeline.backward_high: in shared_mask mode the backward follows the "
                "forward's mask; only forward_high can adapt."
            )
        low = pipeline.link(fwd, bwd, mode=cfg["backward_mode"])
        if fwd_hi is None and bwd_hi is None:
            out.append(low)
            continue
        high = pipeline.link(
            low.forward if fwd_hi is None else fwd_hi,
            low.backward if bwd_hi is None else bwd_hi,
            mode=cfg["backward_mode"],
        )
        out.append(pipeline.adaptive_link(low, high))
    return tuple(out)


def detector_of(cfg: dict, links, config, steps_per_epoch: int):
    """``pipeline.Detector`` for ``config.pipeline.detector`` when a link is adaptive."""
    adaptive = any(isinstance(lk, pipeline.AdaptiveLink) for lk in links)
    if not adaptive:
        if cfg["detector"] is not None:
            raise ValueError(
                "config.pipeline.detector is set but no link is adaptive: give "
                "config.pipeline.forward_high and/or backward_high."
            )
        return None
    sub = _config.check_sub_config("pipeline.detector", cfg["detector"], DETECTOR_DEFAULTS)
    steps = _config.interval_steps("config.pipeline.detector", sub, steps_per_epoch)
    return pipeline.Detector(
        steps, sub["check_every"], sub["eta"], learning_rate=_config.learning_rate(config)
    )


def replica_mean_of(
    cfg: dict, config, replicas: int, steps_per_epoch: int, num_samples: int, axis=comm.DATA
):
    """``(transform or None, description)`` for ``config.pipeline.replica_mean``: the same
    keys and defaults as ``config.data_parallel``, averaging over ``axis`` (the data axis or a
    ``(slow, fast)`` pair)."""
    spec = cfg["replica_mean"]
    if spec is None:
        return None, "float32 pmean"
    if cfg["simulate"] or replicas < 2:
        raise ValueError(
            "config.pipeline.replica_mean averages the gradients of data replicas: it needs "
            f"the distributed pipeline on a mesh with a 'data' axis of >= 2 devices (simulate="
            f"{cfg['simulate']}, {replicas} replica(s))."
        )
    sub = _config.check_sub_config("pipeline.replica_mean", spec, _dp_mode.DP_DEFAULTS)
    # accordion_batch_size is not an average (it changes the batch per update)
    _validate.check_choice(
        "config.pipeline.replica_mean.transform", sub["transform"], REPLICA_TRANSFORMS
    )
    schedule = _config.learning_rate(config)
    # not sharded over fast: the replicas' states are packed per stage and replica
    # (pipeline._driver), with no per-device placement of a PerDevice part
    return _dp_mode._reducer(sub, schedule, steps_per_epoch, num_samples, axis, shard_fast=False)


def high_names(links) -> str:
    lk = next(lk for lk in links if isinstance(lk, pipeline.AdaptiveLink))
    return f"{lk.high.forward.name} / {lk.high.backward.name if lk.high.backward else 'mask'}"
