r"""AB-Training's phase schedule and learning-rate rebound, as pure functions of the step count.

With ``w = warmup_steps``, ``S = sync_every`` and ``D = full_rank_steps`` the reference's
``_post_train_step`` (SPEC §3.5; run after each step, ``t`` = steps completed) gives, for the
step with index ``t``:

* ``t < w``: **warm-up**, full-rank data parallelism over all workers;
* ``w <= t < s1`` with ``s1 = (w // S + 1) * S``: the first **AB** phase (untruncated);
* ``t >= s1``: ``t % S < D`` **full-rank** "rebound" steps (entered by a sync), then
  ``S - D`` **AB** steps (entered by a truncated re-factorisation).

So one cycle is ``S`` steps. A *switch* is the first step of a new phase; after each one the
learning rate rebounds (``_setup_lr_rebound`` / ``_pre_forward``): it is set to a floor
(``1e-5``) and then rises linearly to the schedule's value at the switch over ``rebound_steps``.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from typing import Any

import jax.numpy as jnp
import optax

from jaxcomp import _validate


class ABPhase(enum.IntEnum):
    """Training phase, as stored in :class:`~jaxcomp.transforms.ABTrainingState` ``.phase``."""

    WARMUP = 0  #: full-rank data parallelism over all workers
    AB = 1  #: group-local training of one factor
    FULL = 2  #: full-rank "rebound" steps after a sync


#: What one step does (static): a dense step, a dense step that ends by re-factorising with
#: truncation, an AB step, or an AB step that ends by syncing the groups.
STEP_KINDS = ("dense", "dense_then_refactor", "ab", "ab_then_sync")


@dataclasses.dataclass(frozen=True)
class ABSchedule:
    """The phase schedule of AB-Training (static ints).

    Attributes:
      warmup_steps: full-rank steps before the first AB phase (``>= 0``).
      sync_every: ``S``, steps per cycle; groups sync when the step count is a multiple of it.
      full_rank_steps: ``D``, full-rank steps after each sync (``1 <= D < S``).

    Example:
      >>> s = ABSchedule(warmup_steps=5, sync_every=4, full_rank_steps=1)
      >>> [int(s.phase(t)) for t in range(12)]
      [0, 0, 0, 0, 0, 1, 1, 1, 2, 1, 1, 1]
      >>> s.step_kind(7), s.step_kind(8)
      ('ab_then_sync', 'dense_then_refactor')
    """

    warmup_steps: int
    sync_every: int
    full_rank_steps: int

    def __post_init__(self):
        for name, low in (("warmup_steps", 0), ("sync_every", 2), ("full_rank_steps", 1)):
            object.__setattr__(self, name, _validate.check_int(name, getattr(self, name), low))
        if self.full_rank_steps >= self.sync_every:
            raise ValueError(
                f"full_rank_steps must be < sync_every ({self.sync_every}); "
                f"got {self.full_rank_steps}."
            )

    @property
    def first_sync(self) -> int:
        """Step index of the first full-rank step after a sync, ``(w // S + 1) * S``."""
        return (self.warmup_steps // self.sync_every + 1) * self.sync_every

    def phase(self, count: Any) -> Any:
        """:class:`ABPhase` (as ``int32``) of the step with index ``count`` (traceable)."""
        count = jnp.asarray(count)
        cycle = jnp.where(count % self.sync_every < self.full_rank_steps, ABPhase.FULL, ABPhase.AB)
        phase = jnp.where(count >= self.first_sync, cycle, ABPhase.AB)
        return jnp.where(count < self.warmup_steps, ABPhase.WARMUP, phase).astype(jnp.int32)

    def last_switch(self, count: Any) -> Any:
        """Index of the first step of the current phase, or ``-1`` before any switch."""
        count = jnp.asarray(count)
        u = count % self.sync_every
        in_cycle = jnp.where(u < self.full_rank_steps, count - u, count - u + self.full_rank_steps)
        w = self.warmup_steps
        first = jnp.where((count >= w) & (w > 0), w, -1)
        return jnp.where(count >= self.first_sync, in_cycle, first).astype(jnp.int32)

    def phase_of(self, count: int) -> int:
        """:meth:`phase` on the host, for an int ``count`` (no device work).

        Raises:
          TypeError: if ``count`` is not an integer.
          ValueError: if ``count`` is negative.
        """
        count = operator.index(count)
        if count < 0:
            raise ValueError(f"step count must be >= 0; got {count}.")
        if count < self.warmup_steps:
            return int(ABPhase.WARMUP)
        if count < self.first_sync or count % self.sync_every >= self.full_rank_steps:
            return int(ABPhase.AB)
        return int(ABPhase.FULL)

    def step_kind(self, count: int) -> str:
        """Which of :data:`STEP_KINDS` the step with index ``count`` is (an int, on the host:
        the harness asks every step, so no device work)."""
        now, nxt = self.phase_of(count), self.phase_of(operator.index(count) + 1)
        if now == ABPhase.AB:
            return "ab_then_sync" if nxt == ABPhase.FULL else "ab"
        return "dense_then_refactor" if (now, nxt) == (ABPhase.FULL, ABPhase.AB) else "dense"

    def learning_rate(
        self,
        base: optax.ScalarOrSchedule,
        rebound_steps: int,
        floor: float = 1e-5,
    ) -> optax.Schedule:
        r"""``base`` with the reference's learning-rate rebound after each switch.

        For the ``k``-th step of a phase (``k = 1, 2, ...``) that began at step ``s``:

        .. math::
          \eta_k = \begin{cases}
            \min(\eta(t), f) & k = 1 \\
            \min\!\big(\eta(t), \max(k\,(\eta(s) - f)/R,\ f)\big) & 2 \le k \le R \\
            \eta(t) & k > R
          \end{cases}

        with floor :math:`f` and :math:`R` = ``rebound_steps``. This is the reference's rule
        where :math:`\eta(s) \ge (R+1) f`; below that the reference's ramp would reach zero or
        negative rates, which this schedule never does (it never goes below ``min(eta, f)``).

        Args:
          base: the learning rate or schedule without rebound.
          rebound_steps: ``R``; ``0`` disables the rebound (``base`` is returned).
          floor: :math:`f`, the rate right after a switch (the reference hard-codes ``1e-5``).

        Returns:
          An optax schedule of the step count.
        """
        _validate.check_int("rebound_steps", rebound_steps, 0)
        if not floor > 0:
            raise ValueError(f"floor must be > 0; got {floor!r}.")
        base_fn = base if callable(base) else (lambda _: base)
        if rebound_steps == 0:
            return base_fn

        def schedule(count):
            start = self.last_switch(count)
            k = count - start + 1
            lr = jnp.asarray(base_fn(count), jnp.float32)
            ramp = k * jnp.maximum(base_fn(jnp.maximum(start, 0)) - floor, 0.0) / rebound_steps
            rebound = jnp.where(
                k == 1, jnp.minimum(lr, floor), jnp.minimum(lr, jnp.maximum(ramp, floor))
            )
            return jnp.where((start >= 0) & (k <= rebound_steps), rebound, lr)

        return schedule

    def rebound_multiplier(
        self, base: optax.ScalarOrSchedule, rebound_steps: int, floor: float = 1e-5
    ) -> optax.Schedule:
        """``learning_rate(base, ...)(t) / base(t)`` (1 where ``base(t) == 0``).

        Compose it with ``optax.scale_by_schedule`` to add the rebound to another optimizer.
        """
        base_fn = base if callable(base) else (lambda _: base)
        effective = self.learning_rate(base, rebound_steps, floor)

        def multiplier(count):
            b = jnp.asarray(base_fn(count), jnp.float32)
            return jnp.where(b == 0, 1.0, effective(count) / jnp.where(b == 0, 1.0, b))

        return multiplier
