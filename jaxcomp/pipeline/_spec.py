"""A pipeline's static description (:class:`Spec`), shared by its driver's programs."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from jaxcomp.comm import _mesh
from jaxcomp.pipeline import _config
from jaxcomp.pipeline import _residuals


class Spec(NamedTuple):
    """A pipeline, statically (hashable).

    Attributes:
      model: the :class:`StagedModel`.
      links: one :class:`Link` per boundary.
      num_microbatches: ``M``.
      schedule: ``"gpipe"`` or ``"1f1b"``.
      fns: the stages' objectives (:func:`jaxcomp.pipeline._residuals.stage_fns`).
      mesh: the ``(data,) stage`` mesh, or ``None`` for the single-device simulation.
      replicas: data replicas (``1`` without a ``data`` axis of size > 1; with an axis pair, the
        product of the two sizes).
      replica_mean: the optax transform averaging the replicas' gradients over ``data``, or
        ``None`` (``pmean``; also with one replica, where there is nothing to average).
      adaptive: the adaptive boundaries (:class:`jaxcomp.pipeline._adaptive.Adaptive`) or
        ``None``; ``links`` are then those of the mode combination the program runs.
      data_axes: the replicas' mesh axes: ``("data",)``, or a ``(slow, fast)`` pair of a
        hierarchical mesh (the replicas are the devices of both; ``replica_mean`` averages
        over the pair, e.g. dense over ``fast`` and compressed over ``slow``).
    """

    model: _config.StagedModel
    links: tuple[_config.Link, ...]
    num_microbatches: int
    schedule: str
    fns: tuple[_residuals.StageFns, ...]
    mesh: jax.sharding.Mesh | None
    replicas: int
    replica_mean: Any = None
    adaptive: Any = None
    data_axes: tuple[str, ...] = (_mesh.DATA,)

    @property
    def lead(self) -> tuple[int, ...]:
        num = self.model.num_stages
        return (num, self.replicas) if self.replicas > 1 else (num,)

    @property
    def axes(self) -> tuple[str, ...]:
        return (_mesh.STAGE, *self.data_axes) if self.replicas > 1 else (_mesh.STAGE,)

    @property
    def data(self) -> str | tuple[str, ...]:
        """The replicas' axis name for collectives (a tuple for a pair)."""
        return self.data_axes[0] if len(self.data_axes) == 1 else self.data_axes

    @property
    def replica_lead(self) -> tuple[int, ...]:
        """Leading dims of the averaging transform's state: ``(S, D)``; with a pair
        ``(S, slow size)``: it belongs to a slow worker (the fast axis is averaged first)."""
        if len(self.data_axes) == 2 and self.replicas > 1:
            return (self.model.num_stages, self.mesh.shape[self.data_axes[0]])
        return self.lead

    @property
    def replica_spec(self) -> P:
        """The transform state's spec: as the link states', or ``(stage, slow)`` with a pair."""
        if len(self.data_axes) == 2 and self.replicas > 1:
            return P(_mesh.STAGE, self.data_axes[0])
        return self.state_spec

    @property
    def state_spec(self) -> P:
        return P(_mesh.STAGE, self.data) if self.replicas > 1 else P(_mesh.STAGE)

    @property
    def batch_spec(self) -> P:
        return P(self.data) if self.replicas > 1 else P()
