r"""AB-Training: bytes per phase vs plain data parallelism (VGG-16, from HLO) and step time per
step kind vs a dense data-parallel step (the digits MLP, timed).

``python -m jaxcomp.bench ab_training [--json PATH] [--models ...] [--rank-fractions ...]
[--repeats N] [--no-bytes] [--no-time] [--rows-per-worker R ...] [--trainer-runs N]``

**Bytes** (nothing is trained): every step kind of :func:`jaxcomp.transforms.ab_training` is
compiled on its own for the parameter shapes of a VGG-16 (``vgg16_cifar``: 13 convolutions and
a 512 -> 10 classifier, 15M parameters; ``vgg16_timm``: the paper's timm ``vgg16`` with its 7x7
and 1x1 ``pre_logits`` convolutions, 134M), on 8 workers in 2 groups of 4 (the paper's CIFAR-10
VGG-16 run: 8 GPUs, ``group_size`` 4), and the collectives are read from the compiled HLO. The
first convolution and the classifier stay full-rank (``features.0``, ``head.fc`` in the
reference). Per worker and step: ``dp_hlo_bytes_per_step`` is a plain data-parallel step
(``pmean`` of all gradients over the 8 workers, then Adam). AB steps are averaged over the
group roles (half the groups train A, half B; ``only-b``: all train B). Ranks after a
truncated re-factorisation depend on the trained weights, so the truncated AB phase is reported
for *assumed* ranks, a fraction of ``min(m, n)`` per layer (``rank_fraction``), with the
factors cut to that capacity (:func:`~jaxcomp.parallel.fit_rank_capacity`). Phases:
``warmup`` and ``full`` (dense), ``refactor`` (the last full-rank step of a cycle, plus the rank
agreement), ``ab_untruncated`` (the first AB phase), ``ab`` (truncated), ``sync`` (the last AB
step of a cycle), ``cycle`` (the mean over one steady-state cycle of ``S`` steps: ``D``
full-rank and ``S - D`` AB steps; the paper's ``S = 759, D = 60``; ``traffic_reduction`` is
``1 - cycle / dp``) and ``run`` (the whole 15000-step run of that config). These records have
``step_time_s = None``: a 15M/134M-parameter step is not timed on CPU.

**Time** (:mod:`jaxcomp.bench._ab_timing`): the model, mesh and options of
``configs/digits_ab.py`` (the MLP 64-256-256-256-10, 8 workers in 2 groups, rank capacity 64
of 256, ``fc1`` and ``head`` full-rank), at ``--rows-per-worker`` rows per worker (default 16
and 128: batch 128, the trainer's digits config, and 1024; each record has
``rows_per_worker``).
Each step kind runs as :func:`~jaxcomp.parallel.ab_data_parallel` runs it (the dense
program, then the re-factorisation's; the AB program, with its sync flag set at a cycle's
last AB step), and ``ab (lax.switch)`` is the optax transform's single
program at an AB step; the baseline is a dense data-parallel step (``pmean`` + Adam,
replicated parameters) of the same model. Like the baseline, these run without the harness's
finiteness check; ``full_checked`` is the dense kind with it. All are timed round-robin, one
call each per round, ``--repeats`` rounds: ``step_time_s`` and ``dense_step_time_s`` are
medians, with their quartiles (``*_q25_s``, ``*_q75_s``); ``time_ratio_to_dense`` is the
median of the per-round ratios, with its quartiles. The machine's load average is recorded
before and after.

The AB kinds run with the factorised forward (:mod:`jaxcomp.ab._forward`,
``factored_forward=models.factored_dense``: the factored layers as :math:`(x A) B`, the factor's
gradient from the backward pass), as the trainer runs them; ``ab (dense forward)`` (phase
``ab_dense_forward``) is the ``ab`` kind through the dense weights and the factor gradient
:math:`G B^\top` or :math:`A^\top G`, for comparison in the same run. ``ab (lax.switch)`` also
copies, in every branch, what that branch passes through (the dense moments at an AB step).
``refactor`` is an SVD per factorised layer, once per cycle. Where the time of each kind goes,
and the measurements: ``docs/performance.md``.

``--trainer-runs N`` also runs ``configs/digits_dense.py`` and ``configs/digits_ab.py`` through
the trainer N times each, alternating, with the same steps, evaluation and checkpoint settings,
and records their wall times (phase ``trainer_run``).
"""

from __future__ import annotations

import math
import os

from jaxcomp._cpu import HostMalloc
from jaxcomp.bench import _common

_common.request_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcomp import comm  # noqa: E402
from jaxcomp import parallel  # noqa: E402
from jaxcomp import transforms  # noqa: E402
from jaxcomp.ab._layout import build_layout  # noqa: E402
from jaxcomp.ab._schedule import STEP_KINDS  # noqa: E402
from jaxcomp.bench._ab_timing import time_kinds  # noqa: E402
from jaxcomp.bench._ab_timing import trainer_runs  # noqa: E402

VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
EXCLUDE = ("features_0", "head")  # the reference's features.0.* and head.fc.*
CYCLE, FULL_RANK_STEPS, WARMUP = 759, 60, 4330  # CIFAR-10 VGG-16 config (SPEC §3.6)
RUN_STEPS = 15000  # its common.yaml: 150 "epochs" of iterations_per_train = 100 steps


def vgg16_params(variant: str) -> dict:
    """``ShapeDtypeStruct`` parameters of a Flax-layout VGG-16 (``HWIO`` kernels)."""
    params, c_in, i = {}, 3, 0
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    for v in VGG16:
        if v == "M":
            continue
        params[f"features_{i}"] = {"kernel": sds(3, 3, c_in, v), "bias": sds(v)}
        c_in, i = v, i + 1
    if variant == "vgg16_timm":
        params["pre_logits_fc1"] = {"kernel": sds(7, 7, 512, 4096), "bias": sds(4096)}
        params["pre_logits_fc2"] = {"kernel": sds(1, 1, 4096, 4096), "bias": sds(4096)}
        params["head"] = {"kernel": sds(4096, 10), "bias": sds(10)}
    elif variant == "vgg16_cifar":
        params["head"] = {"kernel": sds(512, 10), "bias": sds(10)}
    else:
        raise ValueError(f"model must be vgg16_cifar or vgg16_timm; got {variant!r}.")
    return params


def dp_step_bytes(params: dict, mesh: jax.sharding.Mesh) -> float:
    """Per-worker HLO bytes of a plain data-parallel step: ``pmean`` over all workers + Adam."""
    axes = (comm.GROUP, comm.MEMBER)
    workers = NamedSharding(mesh, P(axes))
    tx = optax.adam(1e-3)

    def body(grads, params):
        grads = lax.pmean(jax.tree.map(lambda g: g[0], grads), axes)
        updates, _ = tx.update(grads, tx.init(params), params)
        return optax.apply_updates(params, updates)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P()), out_specs=P())
    n = mesh.size
    grads = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype, sharding=workers), params
    )
    return comm.measure_collectives(jax.jit(fn), grads, params).total_bytes


def compression_ratio(params: dict, fraction: float | None) -> float:
    """Full-rank parameter count over the count trained in AB phases at ``fraction`` ranks."""
    layout = build_layout(params, EXCLUDE)
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    if fraction is None:
        low = sum(s.cols * (s.rows + s.cols) for s in layout.specs)
    else:
        low = sum(capacity(s.cols, fraction) * (s.rows + s.cols) for s in layout.specs)
    return total / (total - sum(s.rows * s.cols for s in layout.specs) + low)


def capacity(cols: int, fraction: float) -> int:
    return max(1, min(cols, round(fraction * cols)))


def measure(model: str, sync_mode: str, fractions: list[float], groups: int) -> list[dict]:
    params = vgg16_params(model)
    mesh = parallel.ab_mesh(groups, jax.devices()[:8])
    config = transforms.ABConfig(
        1e-3, warmup_steps=WARMUP, sync_every=CYCLE, full_rank_steps=FULL_RANK_STEPS,
        exclude=EXCLUDE, sync_mode=sync_mode,
    )  # fmt: skip
    state = jax.eval_shape(transforms.ab_transform(config).init, params)
    dp = dp_step_bytes(params, mesh)

    def mean(reports):  # average over the workers' roles
        num_a = 0 if sync_mode == "only-b" else groups // 2
        weights = {"a": num_a, "b": groups - num_a, "all": groups}
        return sum(weights[r] * rep.total_bytes for r, rep in reports.items()) / groups

    full = transforms.ab_step_bytes(params, mesh, config, state=state)
    base = dict(model=model, sync_mode=sync_mode, dp_hlo_bytes_per_step=dp, groups=groups,
                step_time_s=None, dense_step_time_s=None)  # fmt: skip

    def record(phase, nbytes, fraction=None, **extra):
        return {**base, "phase": phase, "rank_fraction": fraction, "hlo_bytes_per_step": nbytes,
                "ratio_to_dp": nbytes / dp, **extra}  # fmt: skip

    rows = [
        record("warmup", mean(full["dense"]), steps=WARMUP),
        record(
            "ab_untruncated",
            mean(full["ab"]),
            **_roles(full["ab"]),
            compression_ratio=compression_ratio(params, None),
        ),  # fmt: skip
    ]
    dense, refactor = mean(full["dense"]), mean(full["dense_then_refactor"])
    for fraction in fractions:
        caps = [capacity(x.shape[-1], fraction) for x in state.a]
        cut = jax.eval_shape(lambda s, c=caps: parallel.fit_rank_capacity(s, c), state)
        low = transforms.ab_step_bytes(params, mesh, config, state=cut,
                                       kinds=("ab", "ab_then_sync"))  # fmt: skip
        ab, sync = mean(low["ab"]), mean(low["ab_then_sync"])
        cycle = (
            (FULL_RANK_STEPS - 1) * dense + refactor + (CYCLE - FULL_RANK_STEPS - 1) * ab + sync
        ) / CYCLE
        ratio = compression_ratio(params, fraction)
        at_full = {k: mean(v) for k, v in full.items()}
        run = run_mean(at_full, {**at_full, "ab": ab, "ab_then_sync": sync})
        rows += [
            record("full", dense, fraction, steps=FULL_RANK_STEPS - 1),
            record("refactor", refactor, fraction, steps=1),
            record(
                "ab",
                ab,
                fraction,
                steps=CYCLE - FULL_RANK_STEPS - 1,
                compression_ratio=ratio,
                **_roles(low["ab"]),
            ),  # fmt: skip
            record("sync", sync, fraction, steps=1),
            record(
                "cycle",
                cycle,
                fraction,
                steps=CYCLE,
                compression_ratio=ratio,
                traffic_reduction=1 - cycle / dp,
            ),  # fmt: skip
            record("run", run, fraction, steps=RUN_STEPS, traffic_reduction=1 - run / dp),
        ]
    return rows


def _roles(reports) -> dict:
    return {f"hlo_bytes_role_{r}": rep.total_bytes for r, rep in reports.items()}


def run_mean(kind_bytes_first: dict, kind_bytes: dict) -> float:
    """Mean bytes per step over the ``RUN_STEPS`` of the CIFAR-10 VGG-16 schedule.

    ``kind_bytes_first``: bytes per step kind at full capacity (before the first sync);
    ``kind_bytes``: after it (truncated capacity).
    """
    schedule = transforms.ABSchedule(WARMUP, CYCLE, FULL_RANK_STEPS)
    phase = np.asarray(schedule.phase(np.arange(RUN_STEPS + 1)))
    now, nxt = phase[:-1], phase[1:]
    ab = now == transforms.ABPhase.AB
    kinds = np.where(ab, np.where(nxt == transforms.ABPhase.FULL, 3, 2),
                     np.where((now == transforms.ABPhase.FULL) & (nxt == 1), 1, 0))  # fmt: skip
    first = np.arange(RUN_STEPS) < schedule.first_sync
    total = 0.0
    for i, kind in enumerate(STEP_KINDS):
        total += np.sum((kinds == i) & first) * kind_bytes_first[kind]
        total += np.sum((kinds == i) & ~first) * kind_bytes[kind]
    return total / RUN_STEPS


def main(argv: list[str] | None = None, host_malloc: HostMalloc | None = None) -> int:
    p = _common.parser(__doc__, __name__)
    p.add_argument(
        "--models",
        nargs="+",
        default=["vgg16_cifar", "vgg16_timm"],
        help="VGG-16 parameter shapes of the byte analysis",
    )
    p.add_argument(
        "--sync-modes",
        nargs="+",
        default=["only-b", "with-stale"],
        help="AB sync modes of the byte analysis",
    )
    p.add_argument(
        "--rank-fractions",
        nargs="+",
        type=float,
        default=[0.05, 0.1, 0.25],
        help="kept ranks as fractions of each layer's full rank (byte analysis)",
    )
    p.add_argument("--groups", type=int, default=2, help="independent AB worker groups")
    p.add_argument("--no-bytes", action="store_true", help="skip the VGG-16 byte analysis")
    p.add_argument("--no-time", action="store_true", help="skip the step timing")
    p.add_argument(
        "--rows-per-worker",
        nargs="+",
        type=int,
        default=[16, 128],
        help="time the step kinds at these batch rows per worker (16: the digits config)",
    )
    p.add_argument(
        "--trainer-runs",
        type=int,
        default=0,
        help="also time N alternating digits_dense / digits_ab trainer runs",
    )
    args = p.parse_args(argv)
    results = []
    if not args.no_time:
        for rows in args.rows_per_worker:
            results += time_kinds(max(args.repeats, 1), rows)
    if args.trainer_runs:
        results += trainer_runs(args.trainer_runs)
    if not args.no_bytes:
        for model in args.models:
            for mode in args.sync_modes:
                results += measure(model, mode, args.rank_fractions, args.groups)
    print()
    _common.print_table(
        results,
        [
            ("model", "s"),
            ("sync_mode", "s"),
            ("phase", "s"),
            ("rows_per_worker", "d"),
            ("rank_fraction", ".2f"),
            ("hlo_bytes_per_step", ".4g"),
            ("dp_hlo_bytes_per_step", ".4g"),
            ("ratio_to_dp", ".3f"),
            ("step_time_s", ".4f"),
            ("dense_step_time_s", ".4f"),
            ("time_ratio_to_dense", ".3f"),
            ("compression_ratio", ".2f"),
            ("traffic_reduction", ".3f"),
        ],
    )
    _common.write_json(args.json, "ab_training", results, cycle=CYCLE,
                       full_rank_steps=FULL_RANK_STEPS, load=list(os.getloadavg()),
                       host_malloc=host_malloc)  # fmt: skip
    return 0
