"""One link end's state inside the packed link-state buffers: where it lies, how to read, run
and write it back (:class:`EndRef`)."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.comm import _send_vjp
from jaxcomp.feedback import _channel as _channel_rows
from jaxcomp.pipeline import _link_state


class EndRef(NamedTuple):
    """One end's place in the packed buffers, and how to index it.

    ``row`` is ``None`` when the buffers are one device's share (``{name: [L]}`` or
    ``[N, W]``, inside ``shard_map``), or the owning device's row of stacked ``{name: [S,
    ...]}`` buffers (the simulation).
    """

    places: tuple[_link_state.Place, ...]
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


def end_ref(layout: _link_state.StateLayout, role: str, boundary: int, stacked: bool) -> EndRef:
    """The :class:`EndRef` of ``role`` at ``boundary`` (``stacked``: ``[S, ...]`` buffers)."""
    d = _link_state.owner(role, boundary)
    first, last = layout.roles[d][_link_state.ROLES.index(role)]
    return EndRef(
        layout.places[d][first:last], layout.treedefs[d][_link_state.ROLES.index(role)],
        d if stacked else None,
    )  # fmt: skip
