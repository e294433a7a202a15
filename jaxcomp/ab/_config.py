r"""AB-Training's configuration: one validated, immutable object, and the worker-grouping rule.

:class:`ABConfig` holds every option of :func:`~jaxcomp.transforms.ab_training`; the transform,
the grouped data-parallel harness and the byte meter all take it explicitly. Invalid values
raise ``ValueError`` at construction, naming the field and the allowed range.

Worker groups follow the reference (``ABLowRankTrainer.__init__``, SPEC §3.4): with ``N``
workers and ``group_size = k``, there are ``N // k`` groups of ``k`` consecutive workers and the
``N % k`` remainder workers are spread over the first groups, one each; ``group_size = None``
(the reference's ``-1``) gives two halves.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp import _validate
from jaxcomp.ab._schedule import ABSchedule
from jaxcomp.comm import GROUP
from jaxcomp.comm import MEMBER

SYNC_MODES = ("with-stale", "only-learned", "full", "only-b")
COMM_SETUPS = ("groups", "individual")
DENSE_SYNCS = ("average", "first", "keep")


def _is_number(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float))


@dataclasses.dataclass(frozen=True)
class ABConfig:
    r"""Every option of AB-Training (Coquelin et al., 2024), validated at construction.

    Attributes:
      learning_rate: :math:`\eta`, a finite float ``>= 0``, a scalar array (what
        ``optax.inject_hyperparams`` passes; checked when concrete) or an optax schedule of
        the step count.
      warmup_steps: full-rank steps before the first (untruncated) AB phase.
      sync_every: ``S``, the cycle length; groups sync when the step count is a multiple of it.
      full_rank_steps: ``D``, full-rank steps after each sync (``1 <= D < S``).
      inner: gradient transformation that does **not** apply the learning rate (default
        ``optax.scale_by_adam()``; the reference's AdamW is ``optax.chain(optax.scale_by_adam(),
        optax.add_decayed_weights(wd))``). It sees tuples of arrays, so use element-wise ones.
      sync_mode: ``"with-stale"``, ``"only-learned"``, ``"full"`` or ``"only-b"`` (every group
        trains ``B``; ``A = U`` stays fixed and ``split_sigma`` is off), see :mod:`._sync`.
      comm_setup: the reference's ``train_comm_setup``: ``"groups"`` (the trained factor's
        gradient is averaged within the group) or ``"individual"`` (factors train on each
        worker's own gradient: no factor traffic between syncs).
      low_rank_cutoff: relative singular-value cutoff in (0, 1) of the re-factorisations.
      split_sigma: :math:`\sqrt\Sigma` on both factors; if False, :math:`\Sigma` goes to the
        factor the group trains.
      exclude: names of layers kept full-rank (contiguous path components, e.g. ``"Conv_0"``,
        ``"head/kernel"``); each must match some parameter.
      max_rank: static rank capacity of the stored factors (an int ``>= 1``), or None.
      max_rank_fraction: the capacity as a fraction in (0, 1] of ``min(m, n)``, or None. With
        neither, the capacity is full (``min(m, n)``); with both, the smaller applies.
        Collectives carry the capacity, so it sets the bytes on the wire.
      lr_rebound_steps: ``R``: after each phase switch the rate restarts at
        ``lr_rebound_floor`` and climbs back over ``R`` steps; 0 disables it.
      lr_rebound_floor: the rate right after a switch (the reference's ``1e-5``).
      reset_lr_on_sync: the reference's switch for the rebound: False disables it.
      reset_opt: zero every moment of the inner optimizer (counters kept, as the reference's
        ``reset_adam_state``) at each phase switch.
      max_grad_norm: clip the averaged gradients of the trained parameters to this global norm
        (the reference uses 1.0), or None.
      reduce_dense_globally: average the non-factorised parameters' gradients over all
        workers in AB steps too (the reference: within the group).
      dense_sync: what the non-factorised parameters become at a sync: ``"average"`` (the
        mean over all workers), ``"first"`` (worker 0's copy) or ``"keep"`` (each worker's
        own). None: as the reference, ``"average"`` with ``comm_setup="groups"`` except in
        ``only-b`` mode, ``"first"`` otherwise (the reference re-wraps the model in
        ``DistributedDataParallel`` over all ranks, which broadcasts rank 0's copy).
      align_moments: at a re-factorisation, move each factor moment to the new singular
        vector its old one overlaps most, with that overlap's sign (first moments) -- beyond
        the reference, which carries moments by position. False: by position.
      axis_name: the mesh axes of the data-parallel workers, outermost first; a pair
        ``(group_axis, member_axis)`` puts each group on one row of a rectangular mesh.
      group_size: workers per group (the remainder spread over the first groups), or None.
      num_groups: the number of groups (sizes as equal as possible, larger ones first), or
        None. With neither: the rows of a ``(group, member)`` mesh, or two halves of a single
        axis.

    Example:
      >>> cfg = ABConfig(1e-3, warmup_steps=10, sync_every=8, full_rank_steps=2)
      >>> cfg.schedule.step_kind(15)
      'ab_then_sync'
      >>> group_sizes(7, group_size=2)
      (3, 2, 2)
    """

    learning_rate: optax.ScalarOrSchedule
    warmup_steps: int
    sync_every: int
    full_rank_steps: int
    inner: optax.GradientTransformation | None = None
    sync_mode: str = "with-stale"
    comm_setup: str = "groups"
    low_rank_cutoff: float = 0.15
    split_sigma: bool = True
    exclude: Sequence[str] = ()
    max_rank: int | None = None
    max_rank_fraction: float | None = None
    lr_rebound_steps: int = 0
    lr_rebound_floor: float = 1e-5
    reset_lr_on_sync: bool = True
    reset_opt: bool = False
    max_grad_norm: float | None = None
    reduce_dense_globally: bool = False
    dense_sync: str | None = None
    align_moments: bool = True
    axis_name: str | tuple[str, ...] = (GROUP, MEMBER)
    group_size: int | None = None
    num_groups: int | None = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        lr = self.learning_rate
        if _validate.is_array(lr):  # optax.inject_hyperparams passes it as a (traced) array
            if jnp.ndim(lr) != 0 or np.dtype(lr.dtype).kind not in "iuf":
                raise ValueError(f"learning_rate must be a scalar; got an array of shape "
                                 f"{jnp.shape(lr)} and dtype {lr.dtype}.")  # fmt: skip
            if not isinstance(lr, jax.core.Tracer) and not 0 <= float(lr) < math.inf:
                raise ValueError(f"learning_rate must be finite and >= 0; got {lr!r}.")
        elif not callable(lr) and (not _is_number(lr) or not 0 <= lr < math.inf):
            raise ValueError(f"learning_rate must be a finite float >= 0, a scalar array or a "
                             f"schedule; got {lr!r}.")  # fmt: skip
        schedule = ABSchedule(self.warmup_steps, self.sync_every, self.full_rank_steps)
        for name in ("warmup_steps", "sync_every", "full_rank_steps"):  # validated, Python ints
            set_(name, getattr(schedule, name))
        inner = optax.scale_by_adam() if self.inner is None else self.inner
        if not (hasattr(inner, "init") and hasattr(inner, "update")):
            raise ValueError(f"inner must be an optax GradientTransformation; got {inner!r}.")
        set_("inner", inner)
        for name, allowed in (("sync_mode", SYNC_MODES), ("comm_setup", COMM_SETUPS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}; got {getattr(self, name)!r}.")
        if self.dense_sync is not None and self.dense_sync not in DENSE_SYNCS:
            raise ValueError(f"dense_sync must be None or one of {DENSE_SYNCS}; got "
                             f"{self.dense_sync!r}.")  # fmt: skip
        cut = self.low_rank_cutoff
        if not _is_number(cut) or not 0 < cut < 1:
            raise ValueError(f"low_rank_cutoff must be in (0, 1); got {cut!r}.")
        if isinstance(self.exclude, str) or not all(isinstance(n, str) for n in self.exclude):
            raise ValueError(f"exclude must be a sequence of layer names; got {self.exclude!r}.")
        set_("exclude", tuple(self.exclude))
        set_("max_rank", _validate.check_int("max_rank", self.max_rank, 1, optional=True))
        frac = self.max_rank_fraction
        if frac is not None and (not _is_number(frac) or not 0 < frac <= 1):
            raise ValueError(f"max_rank_fraction must be None or in (0, 1]; got {frac!r}.")
        set_("lr_rebound_steps", _validate.check_int("lr_rebound_steps", self.lr_rebound_steps, 0))
        floor = self.lr_rebound_floor
        if not _is_number(floor) or not floor > 0:
            raise ValueError(f"lr_rebound_floor must be a number > 0; got {floor!r}.")
        clip = self.max_grad_norm
        if clip is not None and (not _is_number(clip) or not clip > 0):
            raise ValueError(f"max_grad_norm must be None or a number > 0; got {clip!r}.")
        for name in ("split_sigma", "reset_lr_on_sync", "reset_opt", "reduce_dense_globally",
                     "align_moments"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool; got {getattr(self, name)!r}.")
        axes = (self.axis_name,) if isinstance(self.axis_name, str) else self.axis_name
        if not isinstance(axes, tuple) or not axes or not all(isinstance(a, str) for a in axes):
            raise ValueError(f"axis_name must be a mesh axis name or a tuple of them; got "
                             f"{self.axis_name!r}.")  # fmt: skip
        if len(set(axes)) != len(axes):
            raise ValueError(f"axis_name has a repeated axis: {axes!r}.")
        set_("axis_name", axes)
        set_("group_size", _validate.check_int("group_size", self.group_size, 1, optional=True))
        set_("num_groups", _validate.check_int("num_groups", self.num_groups, 1, optional=True))
        if self.group_size is not None and self.num_groups is not None:
            raise ValueError("give group_size or num_groups, not both.")

    @property
    def schedule(self) -> ABSchedule:
        """The phase schedule."""
        return ABSchedule(self.warmup_steps, self.sync_every, self.full_rank_steps)

    @property
    def effective_split_sigma(self) -> bool:
        """``split_sigma``, forced off in ``only-b`` mode (``A = U``, as the reference)."""
        return self.split_sigma and self.sync_mode != "only-b"

    @property
    def effective_dense_sync(self) -> str:
        """``dense_sync``, or the reference's rule when it is None."""
        if self.dense_sync is not None:
            return self.dense_sync
        groups = self.comm_setup == "groups" and self.sync_mode != "only-b"
        return "average" if groups else "first"

    def lr_schedule(self) -> optax.Schedule:
        """The learning rate with the rebound after each switch (if enabled)."""
        steps = self.lr_rebound_steps if self.reset_lr_on_sync else 0
        return self.schedule.learning_rate(self.learning_rate, steps, self.lr_rebound_floor)

    def capacity(self, cols: int) -> int:
        """Stored rank capacity of a factorised weight whose tall view has ``cols`` columns."""
        cap = cols
        if self.max_rank is not None:
            cap = min(cap, self.max_rank)
        if self.max_rank_fraction is not None:
            cap = min(cap, max(1, int(round(self.max_rank_fraction * cols))))
        return cap

    def members_agree(self, axis_sizes: Sequence[int]) -> bool:
        """Whether the members of each group hold equal values: groups on the rows of a
        ``(group, member)`` mesh with ``comm_setup="groups"``."""
        rows = len(axis_sizes) == 2 and self.group_sizes(axis_sizes) == (
            (axis_sizes[1],) * axis_sizes[0]
        )
        return rows and self.comm_setup == "groups"

    def state_axes(self, mesh: Any) -> tuple[str, ...]:
        """The mesh axes the per-worker state varies over: the group axis if the members of a
        group agree (:meth:`members_agree`; one state entry per group), else every worker
        axis (one entry per worker).

        Args:
          mesh: a mesh (or ``{axis: size}``) with the ``axis_name`` axes.
        """
        shape = dict(getattr(mesh, "shape", mesh))
        sizes = [shape[a] for a in self.axis_name]
        return self.axis_name[:1] if self.members_agree(sizes) else self.axis_name

    def group_sizes(self, axis_sizes: Sequence[int]) -> tuple[int, ...]:
        """The sizes of the worker groups on a mesh with these ``axis_name`` sizes."""
        n = 1
        for s in axis_sizes:
            n *= s
        if self.group_size is None and self.num_groups is None and len(axis_sizes) == 2:
            return (axis_sizes[1],) * axis_sizes[0]  # the rows of a (group, member) mesh
        return group_sizes(n, group_size=self.group_size, num_groups=self.num_groups)


def group_sizes(
    num_workers: int, *, group_size: int | None = None, num_groups: int | None = None
) -> tuple[int, ...]:
    """Sizes of the consecutive worker groups, by the reference's rule (SPEC §3.4).

    Args:
      num_workers: ``N``.
      group_size: ``k``: ``N // k`` groups, the ``N % k`` remainder workers added one each to
        the first groups (the reference's ``group_size``).
      num_groups: ``G``: ``G`` groups of ``N // G`` workers, the remainder added to the first.
        With neither: two halves, the second the larger (the reference's ``group_size=-1``).

    Returns:
      The group sizes, first group first.

    Raises:
      ValueError: if there are fewer workers than one per group, or than ``group_size``.
    """
    if group_size is not None:
        if group_size > num_workers:
            raise ValueError(f"group_size={group_size} is larger than the {num_workers} workers.")
        count = num_workers // group_size
    elif num_groups is not None:
        if num_groups > num_workers:
            raise ValueError(f"num_groups={num_groups} is more than the {num_workers} workers.")
        count = num_groups
    else:
        if num_workers < 2:
            return (num_workers,)
        return (num_workers // 2, num_workers - num_workers // 2)
    base, extra = divmod(num_workers, count)
    return tuple(base + (i < extra) for i in range(count))


def num_a_groups(sync_mode: str, num_groups: int) -> int:
    """How many groups train ``A``: the first ``num_groups // 2``, or none in ``only-b`` mode."""
    return 0 if sync_mode == "only-b" else num_groups // 2
