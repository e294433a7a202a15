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
use) are packed per device and the devices' packs are stacked: :class:`LinkStates` holds
``{name: [S, ...]}`` buffers (``[S, D, ...]`` with ``D`` data replicas) sharded over ``stage``:

* per dtype, one vector ``[S, L]`` of the fixed-size leaves (EF residuals, EF21 estimates),
  ``L`` the largest device's need;
* per-sample buffers (the fields a channel declares in ``Channel.sample_fields``, e.g.
  AQ-SGD's caches ``[N, ...]``) side by side in a matrix ``[S, N, W]`` per dtype and ``N``,
  each device's in its own columns, ``W`` the largest device's width.

So every device stores the live state of its own link ends (padded to the largest device's), and
an AQ-SGD cache costs its live size; the simulation keeps the same layout and reads row ``d``
for device ``d``. Inside a program an end is read and written in place
(:class:`EndRef`, below): fixed-size leaves as slices of the device's vector,
per-sample buffers only at the rows of the microbatch's sample ids, with the feedback layer's
rule (:func:`jaxcomp.feedback.read_rows`): an id outside ``[0, N)`` reads NaN and writes
nothing, a repeated id writes its last occurrence.
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
from jaxcomp.comm import _send_vjp
from jaxcomp.comm._send_vjp import ChannelStates
from jaxcomp.feedback import _channel as _channel_rows
from jaxcomp.pipeline import _config

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


def per_sample_leaves(channel: Any, state: Any) -> tuple[bool, ...]:
    """Flags the leaves of a channel end's state that hold one row per sample id (under the
    fields the channel declares)."""
    if channel is None:
        return tuple(False for _ in jax.tree.leaves(state))
    return tuple(jax.tree.leaves(_send_vjp.sample_buffer_flags(channel, state)))


@dataclasses.dataclass(frozen=True)
class Place:
    """Where one leaf lives: ``buffer`` (a plain vector: ``offset`` in it; a rows matrix:
    first column ``offset``), and the leaf's ``shape`` and ``dtype``."""

    buffer: str
    offset: int
    shape: tuple[int, ...]
    dtype: str
    rows: bool

    @property
    def size(self) -> int:
        return math.prod(self.shape) if not self.rows else math.prod(self.shape[1:])


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Where every link end lives in the packed buffers (static and hashable).

    Attributes:
      places: per device, per leaf of its tree ``(forward sender, forward receiver, backward
        sender, backward receiver)``, the leaf's :class:`Place`.
      roles: per device, per role, the ``(first, last + 1)`` leaf indices of that end.
      treedefs: per device, per role, the end's pytree structure.
      buffers: ``((name, shape without the stage axis, dtype), ...)``.
    """

    places: tuple[tuple[Place, ...], ...]
    roles: tuple[tuple[tuple[int, int], ...], ...]
    treedefs: tuple[tuple[Any, ...], ...]
    buffers: tuple[tuple[str, tuple[int, ...], str], ...]

    @property
    def num_stages(self) -> int:
        return len(self.places)

    def device_bytes(self, device: int) -> int:
        """Live bytes of ``device``'s ends (its own leaves, no padding)."""
        return sum(math.prod(p.shape) * np.dtype(p.dtype).itemsize for p in self.places[device])

    def row_bytes(self) -> int:
        """Bytes each device stores (its share of every buffer, padding included)."""
        return sum(math.prod(shape) * np.dtype(dt).itemsize for _, shape, dt in self.buffers)


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
    sizes: dict[str, tuple] = {}  # buffer name -> (shape without stage axis, dtype)
    places, roles, treedefs = [], [], []
    for row in ends:
        used: dict[str, int] = {}
        device_places, ranges, defs, start = [], [], [], 0
        for st, ch, _ in row:
            leaves = jax.tree.leaves(st)
            for leaf, rows in zip(leaves, per_sample_leaves(ch, st)):
                dt = np.dtype(leaf.dtype).name
                shape = tuple(int(d) for d in leaf.shape)
                name = f"{dt}[{shape[0]} rows]" if rows else dt
                size = math.prod(shape[1:]) if rows else math.prod(shape)
                device_places.append(Place(name, used.get(name, 0), shape, dt, rows))
                used[name] = used.get(name, 0) + size
            ranges.append((start, start + len(leaves)))
            defs.append(jax.tree.structure(st))
            start += len(leaves)
        for name, n in used.items():
            rows_of = next(p for p in device_places if p.buffer == name)
            lead = (rows_of.shape[0],) if rows_of.rows else ()
            old = sizes.get(name, ((*lead, 0), rows_of.dtype))[0]
            sizes[name] = ((*lead, max(old[-1], n)), rows_of.dtype)
        places.append(tuple(device_places))
        roles.append(tuple(ranges))
        treedefs.append(tuple(defs))
    seen = {f"{SEEN}[{p.shape[0]} rows]": ((p.shape[0], 1), "uint8") for row in places
            for p in row if p.rows}  # fmt: skip
    sizes.update(seen)
    buffers = tuple((name, *sizes[name]) for name in sorted(sizes))
    return StateLayout(tuple(places), tuple(roles), tuple(treedefs), buffers)


SEEN = "seen"


def has_seen(layout: StateLayout) -> bool:
    """Whether ``layout`` holds per-sample buffers (and so their ``seen`` flags)."""
    return any(name.startswith(f"{SEEN}[") for name, _, _ in layout.buffers)


def _seen_weights(layout: StateLayout, rows: int) -> np.ndarray:
    """Per device, how many of its sender ends keep per-sample buffers of ``rows`` rows."""
    out = np.zeros(layout.num_stages, np.int32)
    for d in range(layout.num_stages):
        for r, role in enumerate(ROLES):
            first, last = layout.roles[d][r]
            if role.endswith("send") and any(
                p.rows and p.shape[0] == rows for p in layout.places[d][first:last]
            ):
                out[d] += 1
    return out


def mark_seen(
    buffers: dict[str, jax.Array], layout: StateLayout, ids: jax.Array | None, device: Any
) -> tuple[dict[str, jax.Array], jax.Array]:
    r"""Marks the rows a training step writes, and counts the sends that met a cold buffer.

    Every training step writes each per-sample end at every valid id of each microbatch
    (a compressed send and a dense warm-up send alike), so one flag per device and sample
    (``seen[N rows]``, ``uint8[N, 1]``, local state that never travels) says whether this
    device's buffers hold a row it filled. A send *met a cold buffer* when its sender end's
    row was never filled here: the channel then encodes against a zero cache (AQ-SGD's
    ``m_com``), i.e. sends plain compression of the full value. A zero row test cannot
    replace the flag: a filled row may be all zero (a ReLU output, a residual after a
    lossless send).

    .. math::
      \text{cold} = \sum_{m} \sum_{i \in \text{ids}_m,\ 0 \le i < N} w_d\,
      [\text{seen}_d(i) = 0], \quad \text{seen}_d(\text{ids}_m) \leftarrow 1

    with :math:`w_d` the number of per-sample sender ends on device :math:`d`; within one
    microbatch a repeated id counts at every occurrence (each reads the row as it was before
    the microbatch), an id outside ``[0, N)`` never (it reads NaN: the loss says so).

    Args:
      buffers: one device's share (``device`` its traced stage index) or the simulation's
        stacked ``[S, ...]`` buffers (``device=None``).
      layout: their :class:`StateLayout`.
      ids: the step's sample ids, ``[microbatches, mb]`` (``None``: no per-sample buffers).
      device: the stage index inside ``shard_map``, or ``None`` for stacked buffers.

    Returns:
      ``(buffers with the flags set, cold)``: ``cold`` an ``int32`` scalar, this device's
      (or, stacked, every device's) count.
    """
    buffers, cold = dict(buffers), jnp.zeros((), jnp.int32)
    names = [name for name, _, _ in layout.buffers if name.startswith(f"{SEEN}[")]
    if ids is None or not names:
        return buffers, cold
    for name in names:
        flags = buffers[name]
        rows = flags.shape[-2]  # [N, 1] (one device's) or [S, N, 1] (stacked)
        weights = jnp.asarray(_seen_weights(layout, rows))
        weight = weights if device is None else weights[device]
        for m in range(ids.shape[0]):
            i = ids[m].astype(jnp.int32)
            valid = (i >= 0) & (i < rows)
            before = flags[:, i, 0] if device is None else flags[i, 0]
            fresh = jnp.where(valid, before == 0, False).astype(jnp.int32)
            cold = cold + jnp.sum(weight * (fresh.sum(-1) if device is None else fresh.sum()))
            where = jnp.where(valid, i, rows)
            if device is None:
                flags = flags.at[:, where, 0].set(jnp.uint8(1), mode="drop")
            else:
                flags = flags.at[where, 0].set(jnp.uint8(1), mode="drop")
        buffers[name] = flags
    return buffers, cold


def init_buffers(
    links: Sequence[_config.Link], shapes: Sequence[Any], layout: StateLayout
) -> dict[str, jax.Array]:
    """Every end's initial state, packed: ``{name: [S, ...]}``."""
    trees = []
    for d in range(layout.num_stages):
        row = []
        for role in ROLES:
            b = owned_boundary(role, d, layout.num_stages)
            if b is not None:
                both = _send.init_channel_states(_channel(links[b], role), shapes[b])
                row.append(_end_of(both, role))
        trees.append(row)
    out = {}
    for name, shape, dt in layout.buffers:
        per_device = []
        for d, tree in enumerate(trees):
            parts = [
                leaf.reshape((leaf.shape[0], -1) if p.rows else (-1,)).astype(dt)
                for leaf, p in zip(jax.tree.leaves(tree), layout.places[d]) if p.buffer == name
            ]  # fmt: skip
            used = sum(x.shape[-1] for x in parts)
            if used < shape[-1]:
                parts.append(jnp.zeros((*shape[:-1], shape[-1] - used), dt))
            per_device.append(jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0])
        out[name] = jnp.stack(per_device)
    return out


@jax.tree_util.register_pytree_node_class
class LinkStates:
    """Every link end's state, packed per device (see the module docstring), with
    compressed replica averaging each stage device's state of the averaging transform, and
    with a stateful model each stage's running state (BatchNorm statistics).

    A pytree whose leaves are the ``{name: [S, ...]}`` buffers (``[S, D, ...]`` with data
    replicas) and whose static data are the layouts, so it passes through ``jax.jit``, orbax
    and ``jax.device_put`` like any state. Read the ends with :meth:`ends` and a stage's
    averaging state with :meth:`replica_state`.

    Attributes:
      buffers: the link ends, ``{name: [S, (D,) ...]}``.
      layout: their :class:`StateLayout`.
      replica: the averaging transform's states, one per stage packed per dtype
        (``{dtype: [S, D, L]}``; empty without a transform).
      replica_layout: their :class:`~jaxcomp.pipeline.ParamLayout` (``None`` without one).
      adaptive: with adaptive links (:func:`~jaxcomp.pipeline.adaptive_link`), the detector's
        :class:`~jaxcomp.pipeline.DetectorState` (replicated; ``None`` without).
      model: a stateful model's running state, one tree per stage packed per dtype
        (``{dtype: [S, (D,) L]}``, each replica its own; empty for a stateless model).
      model_layout: its :class:`~jaxcomp.pipeline.ParamLayout` (``None`` without one).
    """

    def __init__(
        self,
        buffers: dict[str, jax.Array],
        layout: StateLayout,
        replica: dict[str, jax.Array] | None = None,
        replica_layout: Any = None,
        adaptive: Any = None,
        model: dict[str, jax.Array] | None = None,
        model_layout: Any = None,
    ):
        self.buffers = dict(buffers)
        self.layout = layout
        self.replica = dict(replica or {})
        self.replica_layout = replica_layout
        self.adaptive = adaptive
        self.model = dict(model or {})
        self.model_layout = model_layout

    def tree_flatten(self):
        names, rnames = tuple(sorted(self.buffers)), tuple(sorted(self.replica))
        mnames = tuple(sorted(self.model))
        children = (
            tuple(self.buffers[n] for n in names)
            + tuple(self.replica[n] for n in rnames)
            + tuple(self.model[n] for n in mnames)
        )
        aux = (names, rnames, self.layout, self.replica_layout)
        if self.model_layout is not None:  # stateless: the structure checkpoints had before
            aux = (*aux, mnames, self.model_layout)
        return (*children, self.adaptive), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        names, rnames, layout, replica_layout = aux[:4]
        mnames, model_layout = aux[4:] if len(aux) > 4 else ((), None)
        buffers = dict(zip(names, children[: len(names)]))
        replica = dict(zip(rnames, children[len(names) : len(names) + len(rnames)]))
        model = dict(zip(mnames, children[len(names) + len(rnames) : -1]))
        return cls(buffers, layout, replica, replica_layout, children[-1], model, model_layout)

    def model_state(self, stage: int, replica: int = 0) -> Any:
        """Stage ``stage``'s running state (e.g. ``{"batch_stats": ...}``) as replica
        ``replica`` holds it.

        Raises:
          ValueError: if these states carry no model state.
        """
        if self.model_layout is None:
            raise ValueError("these link states carry no model state (the model is stateless).")
        host = {g: np.asarray(b)[stage] for g, b in self.model.items()}
        host = {g: b[replica] if b.ndim > 1 else b for g, b in host.items()}  # [D, L] -> [L]
        return self.model_layout.unpack_stage(stage, host)

    def replica_state(self, stage: int, replica: int = 0) -> Any:
        """Stage ``stage``'s state of the replica-averaging transform, as replica ``replica``
        holds it (per-worker parts with their leading axis of 1)."""
        if self.replica_layout is None:
            raise ValueError("these link states have no replica-averaging transform state.")
        host = {g: np.asarray(b)[stage, replica] for g, b in self.replica.items()}
        return self.replica_layout.unpack_stage(stage, host)

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
        layout = self.layout
        host = {g: np.asarray(b) for g, b in self.buffers.items()}
        full = {name: len(shape) + 1 for name, shape, _ in layout.buffers}
        if any(host[n].ndim > full[n] for n in host):
            if replica is None:
                raise ValueError("these link states hold several data replicas; pass replica=.")
            host = {g: b[:, replica] for g, b in host.items()}
        trees = []
        for d in range(layout.num_stages):
            leaves = [
                host[p.buffer][d][:, p.offset : p.offset + p.size].reshape(p.shape) if p.rows
                else host[p.buffer][d][p.offset : p.offset + p.size].reshape(p.shape)
                for p in layout.places[d]
            ]  # fmt: skip
            ends = []
            for r, (first, last) in enumerate(layout.roles[d]):
                ends.append(jax.tree.unflatten(layout.treedefs[d][r], leaves[first:last]))
            trees.append(ends)
        out = []
        for b in range(layout.num_stages - 1):
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
    for name, shape, dt in layout.buffers:
        b = got.buffers.get(name)
        want = (*lead, *shape)
        if b is None or tuple(jnp.shape(b)) != want or b.dtype != np.dtype(dt):
            have = None if b is None else f"{b.dtype}{list(jnp.shape(b))}"
            raise ValueError(
                f"link_states buffer {name!r} is {have}; this pipeline expects {dt}{list(want)} "
                "(initialise them for the same batch and microbatches)."
            )


# ----------------------------------------------------------------------------------------------
# One link end's state inside the packed link-state buffers: where it lies, how to read,
# run and write it back (:class:`EndRef`).


class EndRef(NamedTuple):
    """One end's place in the packed buffers, and how to index it.

    ``row`` is ``None`` when the buffers are one device's share (``{name: [L]}`` or
    ``[N, W]``, inside ``shard_map``), or the owning device's row of stacked ``{name: [S,
    ...]}`` buffers (the simulation).
    """

    places: tuple[Place, ...]
    treedef: Any
    row: int | None

    @property
    def has_rows(self) -> bool:
        return any(p.rows for p in self.places)

    def _prefix(self) -> tuple:
        return () if self.row is None else (self.row,)

    def run(self, active, fn, fallback, buffers, ids, x):
        """Runs the end, ``fn(state, ids) -> (out, state)``, where ``active`` (the end accessor
        contract of :class:`jaxcomp.comm._send_vjp.StateEnd`): only the microbatch's rows of
        per-sample buffers enter the ``lax.cond`` (with local ids ``0 .. mb - 1``), and the
        state is written back to ``buffers`` outside it."""
        rows = ids is not None and self.has_rows
        part = self.read(buffers, ids if rows else None)
        local_ids = jnp.arange(x.shape[0], dtype=ids.dtype) if rows else ids
        out, new = _send_vjp.gated(active, lambda: fn(part, local_ids), lambda: (fallback(), part))
        if not self.places:
            return out, buffers
        return out, self.write(buffers, ids if rows else None, new)

    def read(self, buffers: dict[str, jax.Array], ids: jax.Array | None) -> Any:
        """The end's state; per-sample buffers only at ``ids``'s rows (so they are ``[mb,
        ...]`` and the channel indexes them with ``0 .. mb - 1``), or whole without ids."""
        leaves = []
        for p in self.places:
            buf = buffers[p.buffer]
            if p.rows:
                full = (
                    buf[self._prefix()] if ids is None
                    else _channel_rows.read_rows(buf, ids, self._prefix())
                )  # fmt: skip
                leaves.append(full[:, p.offset : p.offset + p.size].reshape(-1, *p.shape[1:]))
            else:
                piece = buf[(*self._prefix(), slice(p.offset, p.offset + p.size))]
                leaves.append(piece.reshape(p.shape))
        return jax.tree.unflatten(self.treedef, leaves)

    def write(self, buffers: dict[str, jax.Array], ids: jax.Array | None, state: Any) -> dict:
        """``buffers`` with the end's state (as :meth:`read` returned it) written back."""
        buffers = dict(buffers)
        for p, leaf in zip(self.places, jax.tree.leaves(state)):
            buf = buffers[p.buffer]
            if p.rows and ids is None:  # the whole buffer (outside a step)
                rows = leaf.reshape(leaf.shape[0], -1).astype(buf.dtype)
                start = (0, p.offset) if self.row is None else (self.row, 0, p.offset)
                rows = rows if self.row is None else rows[None]
                buffers[p.buffer] = lax.dynamic_update_slice(buf, rows, start)
            elif p.rows:
                rows = leaf.reshape(leaf.shape[0], -1).astype(buf.dtype)
                if rows.shape[1] != buf.shape[-1]:  # other ends share the rows: keep theirs
                    full = _channel_rows.read_rows(buf, ids, self._prefix())
                    rows = lax.dynamic_update_slice(full, rows, (0, p.offset))
                buffers[p.buffer] = _channel_rows.write_rows(buf, ids, rows, self._prefix())
            else:
                value = leaf.reshape(-1).astype(buf.dtype)
                start = (p.offset,) if self.row is None else (self.row, p.offset)
                value = value if self.row is None else value[None]
                buffers[p.buffer] = lax.dynamic_update_slice(buf, value, start)
        return buffers


def end_ref(layout: StateLayout, role: str, boundary: int, stacked: bool) -> EndRef:
    """The :class:`EndRef` of ``role`` at ``boundary`` (``stacked``: ``[S, ...]`` buffers)."""
    d = owner(role, boundary)
    first, last = layout.roles[d][ROLES.index(role)]
    return EndRef(
        layout.places[d][first:last], layout.treedefs[d][ROLES.index(role)],
        d if stacked else None,
    )  # fmt: skip
