r"""Compact link states: each stage device holds only the ends of the links it owns.

Boundary ``b`` (between stages ``b`` and ``b + 1``) has four ends: the forward channel's sender
(stage ``b``) and receiver (stage ``b + 1``), the backward channel's sender (stage ``b + 1``)
and receiver (stage ``b``). Device ``d`` therefore owns

=================  ====================  =================================================
role               boundary              e.g.
=================  ====================  =================================================
forward sender     ``d``                 EF residual, EF21 estimate, AQ-SGD ``m_com``
forward receiver   ``d - 1``             EF21 estimate, AQ-SGD ``m_dec``
backward sender    ``d - 1``             EF residual of the activation-gradients
backward receiver  ``d``                 EF21 estimate of the activation-gradients
=================  ====================  =================================================

and nothing else. These four states (of whatever channels, shapes and dtypes the boundaries
use) are packed, per dtype, into one vector per device, and the devices' vectors are stacked:
:class:`LinkStates` holds ``{dtype: [S, L]}`` buffers (``[S, D, L]`` with ``D`` data replicas)
sharded over ``stage``, where ``L`` is the largest device's need. So every device stores the
live state of its own link ends (padded to the largest device's), and an AQ-SGD cache costs
its live size; the simulation keeps the same layout and reads row ``d`` for device ``d``.

Inside a program an end is read and written in place: fixed-size leaves as slices of the
device's vector, per-sample buffers (leaves ``[N, ...]`` of a channel with per-sample state)
only at the rows of the microbatch's sample ids; ids outside ``[0, N)`` read zeros and their
writes are dropped (they never touch another leaf).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.comm import _send
from jaxcomp.comm._send_vjp import ChannelStates
from jaxcomp.pipeline import _config
from jaxcomp.pipeline import _params

ROLES = ("forward_send", "forward_recv", "backward_send", "backward_recv")


class LinkState(NamedTuple):
    """The ends of one boundary: ``forward`` and ``backward`` :class:`ChannelStates`."""

    forward: ChannelStates
    backward: ChannelStates


def owner(role: str, boundary: int) -> int:
    """The stage device that holds ``role`` of ``boundary``."""
    return boundary if role in ("forward_send", "backward_recv") else boundary + 1


def owned_boundary(role: str, device: int, num_stages: int) -> int | None:
    """The boundary whose ``role`` end lives on ``device`` (``None``: none)."""
    b = device if role in ("forward_send", "backward_recv") else device - 1
    return b if 0 <= b < num_stages - 1 else None


def _channel(lk: _config.Link, role: str):
    return lk.forward if role.startswith("forward") else lk.backward


def _end_of(states: ChannelStates, role: str) -> Any:
    return states.send if role.endswith("send") else states.recv


def per_sample_leaves(channel: Any, state: Any, like: Any) -> tuple[bool, ...]:
    """Flags the leaves of a channel end's state that are per-sample buffers
    ``[N, *like.shape[1:]]`` (indexed by sample ids)."""
    if channel is None or not channel.per_sample:
        return tuple(False for _ in jax.tree.leaves(state))
    feature = tuple(like.shape[1:])
    return tuple(
        len(a.shape) == len(like.shape) and tuple(a.shape[1:]) == feature
        for a in jax.tree.leaves(state)
    )


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Where every link end lives in the packed per-device vectors (static and hashable).

    Attributes:
      packing: the :class:`ParamLayout` of the per-device trees ``(forward sender, forward
        receiver, backward sender, backward receiver)`` (``None`` where a device has no such
        end).
      roles: per device, per role, the ``(first, last + 1)`` leaf indices of that end.
      treedefs: per device, per role, the end's pytree structure.
      per_sample: per device, per leaf, whether it is a per-sample buffer.
    """

    packing: _params.ParamLayout
    roles: tuple[tuple[tuple[int, int], ...], ...]
    treedefs: tuple[tuple[Any, ...], ...]
    per_sample: tuple[tuple[bool, ...], ...]

    @property
    def num_stages(self) -> int:
        return self.packing.num_stages

    def device_bytes(self, device: int) -> int:
        """Live bytes of ``device``'s ends (its own leaves, no padding)."""
        return self.packing.stage_bytes(device)

    def row_bytes(self) -> int:
        """Bytes each device stores (the packed row, padding included)."""
        return self.packing.row_bytes()


def _end_structs(links, shapes, num_stages):
    """Per device, per role: the end's state structure, channel and boundary shape."""
    out = []
    for d in range(num_stages):
        row = []
        for role in ROLES:
            b = owned_boundary(role, d, num_stages)
            if b is None:
                row.append((None, None, None))
                continue
            ch = _channel(links[b], role)
            both = jax.eval_shape(lambda ch=ch, s=shapes[b]: _send.init_channel_states(ch, s))
            row.append((_end_of(both, role), ch, shapes[b]))
        out.append(row)
    return out


def state_layout(
    links: Sequence[_config.Link], shapes: Sequence[Any], num_stages: int
) -> StateLayout:
    """The compact layout of ``links``' states for boundary activations ``shapes``."""
    ends = _end_structs(links, shapes, num_stages)
    trees = [tuple(st for st, _, _ in row) for row in ends]
    packing = _params.param_layout(trees)
    roles, treedefs, flags = [], [], []
    for row in ends:
        start, ranges, defs, fl = 0, [], [], []
        for st, ch, like in row:
            n = len(jax.tree.leaves(st))
            ranges.append((start, start + n))
            defs.append(jax.tree.structure(st))
            fl += per_sample_leaves(ch, st, like) if n else ()
            start += n
        roles.append(tuple(ranges))
        treedefs.append(tuple(defs))
        flags.append(tuple(fl))
    return StateLayout(packing, tuple(roles), tuple(treedefs), tuple(flags))


def init_buffers(
    links: Sequence[_config.Link], shapes: Sequence[Any], layout: StateLayout
) -> dict[str, jax.Array]:
    """Every end's initial state, packed: ``{dtype: [S, L]}``."""
    trees = []
    for d in range(layout.num_stages):
        row = []
        for role in ROLES:
            b = owned_boundary(role, d, layout.num_stages)
            if b is None:
                row.append(None)
            else:
                both = _send.init_channel_states(_channel(links[b], role), shapes[b])
                row.append(_end_of(both, role))
        trees.append(tuple(row))
    return layout.packing.pack(trees)


@jax.tree_util.register_pytree_node_class
class LinkStates:
    """Every link end's state, packed per device (see the module docstring).

    A pytree whose leaves are the ``{dtype: [S, L]}`` buffers (``[S, D, L]`` with data
    replicas) and whose static data is the :class:`StateLayout`, so it passes through
    ``jax.jit``, orbax and ``jax.device_put`` like any state. Read the ends with :meth:`ends`.
    """

    def __init__(self, buffers: dict[str, jax.Array], layout: StateLayout):
        self.buffers = dict(buffers)
        self.layout = layout

    def tree_flatten(self):
        names = tuple(sorted(self.buffers))
        return tuple(self.buffers[n] for n in names), (names, self.layout)

    @classmethod
    def tree_unflatten(cls, aux, children):
        names, layout = aux
        return cls(dict(zip(names, children)), layout)

    def ends(self, replica: int | None = None) -> tuple[LinkState, ...]:
        """Per boundary, the state of each of its four ends (no stage axis): what the owning
        devices hold. ``replica`` picks a data replica (required when there are several).

        Example:
          >>> import jax, jax.numpy as jnp
          >>> from jaxcomp import compressors, feedback, pipeline
          >>> model = pipeline.StagedModel((lambda w, x: x * w,) * 3, lambda y, t: jnp.mean(y))
          >>> ef = feedback.error_feedback(compressors.top_k(0.5))
          >>> sim = pipeline.simulate(model, pipeline.PipelineConfig(4, pipeline.link(ef)))
          >>> states = sim.init([jnp.ones(2)] * 3, {"x": jnp.ones((8, 2)), "y": jnp.ones(8)})
          >>> states.ends()[1].forward.send.residual.shape  # boundary 1's sender, on stage 1
          (2, 2)
        """
        host = {g: np.asarray(b) for g, b in self.buffers.items()}
        lead = next(iter(host.values())).ndim - 1 if host else 1
        if lead == 2:
            if replica is None:
                raise ValueError("these link states hold several data replicas; pass replica=.")
            host = {g: b[:, replica] for g, b in host.items()}
        num = self.layout.num_stages
        trees = [self.layout.packing.unpack_stage(d, {g: b[d] for g, b in host.items()})
                 for d in range(num)]  # fmt: skip
        out = []
        for b in range(num - 1):
            ends = {role: trees[owner(role, b)][ROLES.index(role)] for role in ROLES}
            out.append(
                LinkState(
                    ChannelStates(ends["forward_send"], ends["forward_recv"]),
                    ChannelStates(ends["backward_send"], ends["backward_recv"]),
                )
            )
        return tuple(out)

    def __repr__(self) -> str:
        shapes = {n: tuple(b.shape) for n, b in self.buffers.items()}
        return f"LinkStates({shapes}, num_stages={self.layout.num_stages})"


def check_link_states(got: Any, layout: StateLayout, lead: tuple[int, ...]) -> None:
    """Raises ``ValueError`` unless ``got`` are link states of ``layout`` with leading axes
    ``lead``."""
    if not isinstance(got, LinkStates):
        raise ValueError(
            "link_states do not match this pipeline's links (use pipe.init(params, batch)); "
            f"got {type(got).__name__}. Link states of the layout before the compact one "
            "(a tuple of LinkState with a slot per stage) cannot be used."
        )
    if got.layout.treedefs != layout.treedefs:
        raise ValueError(
            "link_states do not match this pipeline's links (use pipe.init(params, batch)); "
            f"expected ends {layout.treedefs}, got {got.layout.treedefs}."
        )
    if got.layout != layout:
        raise ValueError(
            "link_states hold ends of other shapes than this pipeline expects (initialise "
            "them for the same batch and microbatches)."
        )
    for g, n in layout.packing.lengths:
        b = got.buffers.get(g)
        want = (*lead, n)
        if b is None or tuple(jnp.shape(b)) != want or b.dtype != np.dtype(g):
            have = None if b is None else f"{b.dtype}{list(jnp.shape(b))}"
            raise ValueError(
                f"link_states buffer {g!r} is {have}; this pipeline expects {g}{list(want)} "
                "(initialise them for the same batch and microbatches)."
            )


class EndRef(NamedTuple):
    """One end's place in the packed vectors, and how to index it.

    ``row`` is ``None`` when the buffers are one device's vectors ``{dtype: [L]}`` (inside
    ``shard_map``), or the owning device's row of stacked ``{dtype: [S, L]}`` buffers.
    """

    slots: tuple[Any, ...]
    per_sample: tuple[bool, ...]
    treedef: Any
    row: int | None

    def _index(self, index):
        return index if self.row is None else (self.row, index)

    def read(self, buffers: dict[str, jax.Array], ids: jax.Array | None) -> Any:
        """The end's state; per-sample buffers only at ``ids``'s rows (so they are ``[mb,
        ...]`` and the channel indexes them with ``0 .. mb - 1``)."""
        leaves = []
        for slot, rows in zip(self.slots, self.per_sample):
            buf, size = buffers[slot.group], math.prod(slot.shape)
            if rows and ids is not None:
                index = _row_index(slot, ids, buf.shape[-1])
                got = buf.at[self._index(index)].get(mode="fill", fill_value=0)
                leaves.append(got.reshape((ids.shape[0], *slot.shape[1:])))
            else:
                piece = buf[self._index(slice(slot.offset, slot.offset + size))]
                leaves.append(piece.reshape(slot.shape))
        return jax.tree.unflatten(self.treedef, leaves)

    def write(self, buffers: dict[str, jax.Array], ids: jax.Array | None, state: Any) -> dict:
        """``buffers`` with the end's state (as :meth:`read` returned it) written back."""
        buffers = dict(buffers)
        for slot, rows, leaf in zip(self.slots, self.per_sample, jax.tree.leaves(state)):
            buf = buffers[slot.group]
            if rows and ids is not None:
                index = _row_index(slot, ids, buf.shape[-1])
                value = leaf.reshape(index.shape).astype(buf.dtype)
                buffers[slot.group] = buf.at[self._index(index)].set(value, mode="drop")
            else:
                value = leaf.reshape(-1).astype(buf.dtype)
                if self.row is None:
                    buffers[slot.group] = lax.dynamic_update_slice(buf, value, (slot.offset,))
                else:
                    buffers[slot.group] = lax.dynamic_update_slice(
                        buf, value[None], (self.row, slot.offset)
                    )
        return buffers


def _row_index(slot: Any, ids: jax.Array, length: int) -> jax.Array:
    """Flat indices ``[mb, F]`` of rows ``ids`` of a ``[N, ...]`` leaf; rows outside
    ``[0, N)`` point past the buffer (``length``), where reads fill and writes drop."""
    n, feature = slot.shape[0], math.prod(slot.shape[1:])
    ok = (ids >= 0) & (ids < n)
    start = jnp.where(ok, slot.offset + ids.astype(jnp.int32) * feature, length)
    return start[:, None] + jnp.arange(feature, dtype=jnp.int32)


def end_ref(layout: StateLayout, role: str, boundary: int, stacked: bool) -> EndRef:
    """The :class:`EndRef` of ``role`` at ``boundary`` (``stacked``: ``[S, L]`` buffers)."""
    d = owner(role, boundary)
    first, last = layout.roles[d][ROLES.index(role)]
    return EndRef(
        layout.packing.slots[d][first:last],
        layout.per_sample[d][first:last],
        layout.treedefs[d][ROLES.index(role)],
        d if stacked else None,
    )
