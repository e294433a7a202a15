"""The tick program every stage device runs inside ``shard_map`` (GPipe or 1F1B).

Per tick (:mod:`jaxcomp.pipeline._schedule`), a ``lax.switch`` on the device's stage index runs
*only its own stage's op*: a forward (saving its residuals into the ring-buffer slot of the
microbatch, :mod:`jaxcomp.pipeline._residuals`), a backward (from the saved residuals,
accumulating the parameter gradient), or nothing. Then every boundary whose sender worked this
tick sends: each encodes its payload, **one** ``ppermute`` carries all of them (one
source-target pair per send; payloads of different sizes cut at their sizes, one permute per
distinct size, no padding: :func:`move_boundaries`), each decodes
(:func:`jaxcomp.pipeline._links.forward_halves`, ``backward_halves``); the receiver consumes it
in the next tick. Under 1F1B a tick's forwards and backwards go in that one move (no stage
receives from both sides in one tick: :func:`tick_moves`); under GPipe no tick sends both ways.
Only the stages active in a tick are compiled into its switch, and only the boundaries active
in it send, so bubble ticks send nothing and touch no state.

**One permute per tick.** gloo (the CPU collectives between processes) sends only once the
receiver has posted its receive, and each host runs its permutes in program order: with one
single-pair permute per boundary, a middle stage relayed a tick's boundaries one after another
(a 4-stage, 4-microbatch GPipe step cost 20 sends' time on a slow link; 12 with one permute
per tick and direction, ``docs/results/network/pipeline_model.md``; a 1F1B step of 4 x 4
moves 13 times rather than 18 with both directions of a tick in one permute).

**Each op traced once.** The ops of one tick program are traced once and reused by every tick that
runs them (:func:`stage_ops`, :func:`link_ops`). A schedule runs stage ``s``'s forward in ``M``
ticks and its backward in ``M`` more; the fill and drain ticks are unrolled, and when each tick's
``lax.switch`` traced the op again, that was 9 traces of every stage per 4-stage training program (3
with the residual plan's, 4 -> 1 per evaluation program), and a boundary's send once per tick. Here
each (stage, op) is a ``jax.jit(..., inline=True)`` made once per program: the first tick traces it,
every later tick with the same abstract inputs gets JAX's cached jaxpr, **inlined** into the tick
(the equations are emitted as they were traced, no call boundary), so the program XLA compiles is
the one the per-tick traces gave.

A stage op takes this device's packed parameters and running state (``{dtype: [L]}``) and
unpacks its stage's share inside, so the (un)packing is traced once too. A boundary's encode
and decode (codec, feedback, link-state reads and writes) are traced once per direction the
same way, and a tick's move once per set of pairs (:class:`LinkOps`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp._bits import byte_size
from jaxcomp._bits import from_bytes
from jaxcomp._bits import move_as_bits
from jaxcomp._bits import to_bytes
from jaxcomp.comm import _local
from jaxcomp.comm import _mesh
from jaxcomp.pipeline import _config
from jaxcomp.pipeline import _links
from jaxcomp.pipeline import _residuals
from jaxcomp.pipeline import _schedule

F, B = _schedule.FORWARD, _schedule.BACKWARD


class Carry(NamedTuple):
    """What a device carries from tick to tick."""

    acts: tuple[jax.Array, ...]  # per boundary: the activation last received (on b + 1)
    cotangents: tuple[jax.Array, ...]  # per boundary: the gradient last received (on b)
    residuals: dict[str, jax.Array]  # {dtype: [slots, R]}: saved residuals per microbatch
    masks: dict[str, jax.Array]  # {dtype: [slots, P]}: shared-mask payloads per microbatch
    grads: dict[str, jax.Array]  # {dtype: [L]}: this stage's accumulated gradient
    states: dict[str, jax.Array]  # {dtype: [L_s]}: this device's link ends
    loss: jax.Array
    metrics: Any
    outputs: jax.Array | None  # evaluation: the last stage's outputs per microbatch
    model: dict[str, jax.Array]  # {dtype: [L_m]}: this stage's running state (BatchNorm)


def _zeros(struct: Any, axes: tuple[str, ...]) -> Any:
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), struct)
    return _local.to_varying(zeros, axes)


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)


def _take(tree: Any, i: Any) -> Any:
    if isinstance(i, (int, np.integer)):
        return jax.tree.map(lambda a: a[int(i)], tree)
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _tables(schedule: str, num: int, m_: int, train: bool) -> tuple[np.ndarray, ...]:
    """``[T, S]`` int32 tables of each stage's forward and backward microbatch (-1: none) and,
    for training, of the residual row it writes (:func:`_schedule.write_slots`)."""
    table = _schedule.ticks(schedule, num, m_, train)
    fwd = np.full((len(table), num), -1, np.int32)
    bwd = np.full((len(table), num), -1, np.int32)
    for t, row in enumerate(table):
        for s, op in enumerate(row):
            if op is not None:
                (fwd if op.kind == F else bwd)[t, s] = op.microbatch
    if not train:
        return fwd, bwd, None
    return fwd, bwd, np.asarray(_schedule.write_slots(schedule, num, m_)[1], np.int32)


def _row(table: np.ndarray, t: Any) -> Any:
    """Row ``t`` of a table: Python ints for a static tick, a traced ``[S]`` array otherwise."""
    return [int(v) for v in table[t]] if isinstance(t, int) else jnp.asarray(table)[t]


def _branch(prog, plan, ops, s: int | None, kinds: tuple, has_f: bool, has_b: bool):
    """Stage ``s``'s op of one tick as a switch branch, with the tick's uniform output type
    (``ops``: the program's :class:`StageOps`)."""
    st, num, axes = prog.static, prog.num_stages, prog.axes
    res_struct = {} if plan is None else _res_struct(plan)
    kind = kinds[s] if s is not None else None

    def outputs(
        ys=None, res=None, loss=None, metrics=None, final=None, dxs=None, dparams=None, model=None
    ):
        out = {}
        if has_f:  # only the boundaries that send this tick (not every one: memory)
            out["ys"] = {
                b: ys if (ys is not None and b == s) else _zeros(sh, ())
                for b, sh in enumerate(st.shapes) if kinds[b] == F
            }  # fmt: skip
            if prog.train:
                out["res"] = res if res is not None else _zeros(res_struct, ())
            out["loss"] = loss if loss is not None else jnp.zeros((), jnp.float32)
            out["metrics"] = metrics if metrics is not None else _zeros(st.metrics, ())
            if prog.collect:
                out["final"] = final if final is not None else _zeros(st.final, ())
            if prog.train:  # the stage's running state: new after a forward, else as it was
                out["model"] = model
        if has_b:
            out["dxs"] = {
                b: dxs if (dxs is not None and b == s - 1) else _zeros(sh, ())
                for b, sh in enumerate(st.shapes) if kinds[b + 1] == B
            }  # fmt: skip
            out["dparams"] = dparams if dparams is not None else _zeros(prog.grad_struct, ())
        return _local.to_varying(out, axes)

    def branch(local, x_in, acts, cotangents, ring, slot_b, lab_f, lab_b, model):
        if kind is None:
            return outputs(model=model)
        h = x_in if s == 0 else acts[s - 1]
        if kind == F and not prog.train:
            if s < num - 1:
                return outputs(ys=ops.evaluate[s](local, model, h, lab_f))
            loss, metrics, y = ops.evaluate[s](local, model, h, lab_f)
            return outputs(loss=loss, metrics=metrics, final=y)
        if kind == F:
            out, aux, res, new_model = ops.forward[s](local, model, h, lab_f)
            if s < num - 1:
                return outputs(ys=out, res=res, model=new_model)
            return outputs(res=res, loss=out, metrics=aux, model=new_model)
        if s == num - 1:
            ct = _local.to_varying(jnp.asarray(1.0 / prog.num_microbatches, jnp.float32), axes)
        else:
            ct = cotangents[s]
        # the ring is only read in here: a row sliced out inside the branch costs no copy
        res_row = {g: lax.dynamic_index_in_dim(r, slot_b, 0, keepdims=False)
                   for g, r in ring.items()}  # fmt: skip
        dparams, dx = ops.backward[s](local, model, res_row, ct, lab_b)
        return outputs(dxs=dx, dparams=dparams, model=model)

    return branch


class Program(NamedTuple):
    """Everything static about one compiled program (hashable)."""

    loss_fn: Any
    links: tuple
    fns: tuple
    static: Any  # _driver.Static
    schedule: str
    num_microbatches: int
    axes: tuple[str, ...]
    compress: bool
    train: bool
    collect: bool

    @property
    def num_stages(self) -> int:
        return len(self.fns)

    @property
    def slots(self) -> int:
        return _schedule.residual_slots(self.schedule, self.num_stages, self.num_microbatches)

    @property
    def grad_struct(self) -> dict:
        return {g: jax.ShapeDtypeStruct((n,), g) for g, n in self.static.layout.lengths}


def _res_struct(plan: _residuals.ResidualPlan) -> dict:
    return {g: jax.ShapeDtypeStruct((n,), g) for g, n in plan.layout.lengths}


def _mask_refs(prog, b: int):
    """The slots of boundary ``b``'s shared-mask payloads in the mask ring's rows: the sent one
    first in stage ``b``'s tree, the received one last in stage ``b + 1``'s."""
    layout, n = prog.static.mask_layout, len(jax.tree.leaves(prog.static.payloads[b]))
    receiver = layout.slots[b + 1]
    return layout.slots[b][:n], receiver[len(receiver) - n :]


def _write_payload(masks, slots, payload, slot, mine):
    masks = dict(masks)
    for sl, leaf in zip(slots, jax.tree.leaves(payload)):
        buf = masks[sl.group]
        n = int(np.prod(sl.shape))
        old = lax.dynamic_slice(buf, (slot, sl.offset), (1, n))
        new = jnp.where(mine, leaf.reshape(1, n).astype(buf.dtype), old)
        masks[sl.group] = lax.dynamic_update_slice(buf, new, (slot, sl.offset))
    return masks


def _read_payload(masks, slots, struct, slot):
    leaves = []
    for sl in slots:
        n = int(np.prod(sl.shape))
        piece = lax.dynamic_slice(masks[sl.group], (slot, sl.offset), (1, n))
        leaves.append(piece.reshape(sl.shape))
    return jax.tree.unflatten(jax.tree.structure(struct), leaves)


def _tick(prog, plan, ops, sends, carry, t, kinds, local, x, labels, ids, key, tables):
    st, num = prog.static, prog.num_stages
    stage = lax.axis_index(_mesh.STAGE)
    row_f, row_b = _row(tables[0], t), _row(tables[1], t)
    has_f, has_b = F in kinds, B in kinds
    slots = prog.slots

    order = [s for s in range(num) if kinds[s] is not None]
    index = jnp.asarray([order.index(s) if s in order else len(order) for s in range(num)])
    branches = [_branch(prog, plan, ops, s, kinds, has_f, has_b) for s in order]
    branches.append(_branch(prog, plan, ops, None, kinds, has_f, has_b))

    static = isinstance(t, int)
    x_in = _take(x, (max(row_f[0], 0) if static else jnp.maximum(row_f[0], 0)))
    last_f = row_f[num - 1] if kinds[num - 1] == F else 0
    last_b = row_b[num - 1] if kinds[num - 1] == B else 0
    lab_f, lab_b = _take(labels, last_f), _take(labels, last_b)
    slot_b = jnp.maximum(jnp.asarray(row_b)[stage], 0) % slots
    out = lax.switch(
        index[stage], branches, local, x_in, carry.acts, carry.cotangents, carry.residuals,
        slot_b, lab_f, lab_b, carry.model,
    )  # fmt: skip
    residuals, grads, loss, metrics, outputs, model = (
        carry.residuals, carry.grads, carry.loss, carry.metrics, carry.outputs, carry.model
    )  # fmt: skip
    if has_f:
        loss = loss + out["loss"]
        if prog.train:
            model = out["model"]
        metrics = jax.tree.map(jnp.add, metrics, out["metrics"])
        if prog.train:  # one row per tick, written without reading the ring first: a
            # select against the old row would make XLA keep a copy of the whole ring
            slot = jnp.asarray(_row(tables[2], t))[stage]
            residuals = {
                g: lax.dynamic_update_index_in_dim(r, out["res"][g], slot, 0)
                for g, r in residuals.items()
            }
        if prog.collect and kinds[num - 1] == F:
            outputs = lax.dynamic_update_index_in_dim(outputs, out["final"], last_f, 0)
    if has_b:
        grads = {g: grads[g] + out["dparams"][g] for g in grads}

    acts, cotangents = list(carry.acts), list(carry.cotangents)
    states, masks = carry.states, carry.masks

    def ids_of(m):
        return None if ids is None else _take(ids, m)

    ends = [(stage == b, stage == b + 1) for b in range(num - 1)]
    rows = {F: row_f, B: row_b}
    xs = {F: out.get("ys"), B: out.get("dxs")}
    # every send of a move encodes, its payloads cross in one ppermute, each decodes; a send is
    # (boundary, direction), its microbatch the one its sender (b, or b + 1 backward) ran
    for pairs in tick_moves(kinds):
        todo = [(min(p), F if p[0] < p[1] else B) for p in pairs]
        sent, payloads = [], {}
        for b, d in todo:
            m = rows[d][b + (d == B)]
            payloads[b, d] = (None, None)
            if d == B and prog.links[b].mode == "shared_mask" and prog.compress:
                sender, receiver = _mask_refs(prog, b)
                payloads[b, d] = tuple(
                    _read_payload(masks, refs, st.payloads[b], m % slots)
                    for refs in (sender, receiver)
                )
            payload, states = sends.encode[d][b](
                xs[d][b], states, payloads[b, d], _links.link_key(key, b, m), ids_of(m), *ends[b]
            )
            sent.append(payload)
        got = sends.move(pairs)(stage, tuple(sent))
        for (b, d), payload, received in zip(todo, sent, got):
            m = rows[d][b + (d == B)]
            decoded, states = sends.decode[d][b](
                received, xs[d][b], states, payloads[b, d], ids_of(m), *ends[b]
            )
            if d == B:
                cotangents[b] = decoded
                continue
            acts[b] = decoded
            if prog.links[b].mode == "shared_mask" and prog.compress and prog.train:
                sender, receiver = _mask_refs(prog, b)
                masks = _write_payload(masks, sender, payload, m % slots, stage == b)
                masks = _write_payload(masks, receiver, received, m % slots, stage == b + 1)
    return Carry(
        tuple(acts), tuple(cotangents), residuals, masks, grads, states, loss, metrics, outputs,
        model,
    )  # fmt: skip


def move_pieces(sizes: Sequence[int]) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    r"""The permutes of one move whose payloads are ``sizes`` bytes (in the move's order), as
    :func:`move_boundaries` cuts them: per distinct non-zero size :math:`n_j`, ascending,
    ``(n_{j-1}, n_j, members)``, bytes :math:`[n_{j-1}, n_j)` of every payload of at least
    :math:`n_j` bytes (``members``: their positions; :math:`n_0 = 0`). Payloads alike are one
    piece, the whole payload: the one permute they move in.

    Example:
      >>> move_pieces([512, 128, 512])
      ((0, 128, (0, 1, 2)), (128, 512, (0, 2)))
    """
    out, low = [], 0
    for high in sorted(set(sizes) - {0}):
        out.append((low, high, tuple(i for i, n in enumerate(sizes) if n >= high)))
        low = high
    return tuple(out)


def tick_moves(kinds: Sequence[str | None]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The moves of a tick whose stages run ``kinds`` (per stage ``"F"``, ``"B"`` or ``None``),
    each as its ``(source, target)`` stage pairs: the forwards ``(b, b + 1)`` of the stages that
    ran a forward, then the backwards ``(b + 1, b)`` of those that ran a backward. A stage runs
    one op, so it sends at most once; where no stage receives twice (1F1B: forwards on ticks of
    one parity of the stage, backwards on the other; GPipe: no tick sends both ways) the pairs
    are one permutation and the tick one move, else one move per direction.

    Example:
      >>> tick_moves(("F", None, "F", "B"))  # 1F1B, tick 4 of 4 x 4: a swap over boundary 2
      (((0, 1), (2, 3), (3, 2)),)
      >>> tick_moves(("F", None, "B"))  # stage 1 would receive from both sides
      (((0, 1),), ((2, 1),))
    """
    num = len(kinds)
    fwd = tuple((b, b + 1) for b in range(num - 1) if kinds[b] == F)
    bwd = tuple((b + 1, b) for b in range(num - 1) if kinds[b + 1] == B)
    targets = [d for _, d in fwd + bwd]
    if len(set(targets)) == len(targets):
        return (fwd + bwd,) if targets else ()
    return tuple(m for m in (fwd, bwd) if m)


def move_boundaries(pairs: tuple[tuple[int, int], ...]) -> Any:
    r"""The ``ppermute`` ops that move one payload over each of ``pairs`` (``(source, target)``
    stages, a move of :func:`tick_moves`: every stage sends and receives at most once), as
    ``move(stage, payloads) -> received`` (tuples in the order of ``pairs``), sending exactly
    the payloads' bytes.

    Every device hands a collective one array of one shape (a payload of several leaves, e.g.
    a quantizer's codes and scale, would be one ``collective-permute`` per leaf): the stage
    that sends selects its pair's payload. Payloads that are one array of one shape and
    dtype move as they are, in one permute (8- and 16-bit floats as their bits,
    :func:`jaxcomp._bits.move_as_bits`). Any other moves as its bytes
    (:func:`jaxcomp._bits.to_bytes`) cut at the move's distinct payload sizes
    :math:`n_1 < \dots < n_k`: permute :math:`j` carries bytes :math:`[n_{j-1}, n_j)` of every
    payload of at least :math:`n_j` bytes (:math:`n_0 = 0`), and each receiver joins its
    pieces. The first permute carries every pair, each later one only the larger payloads'
    rest: nothing is padded, a move sends :math:`\sum |\mathrm{payload}|`
    (:func:`jaxcomp.pipeline._links.step_bytes`) in as many permutes as it has distinct
    payload sizes (one for payloads alike; a 1F1B tick's forward and backward payloads are
    cut together).

    Cut rather than grouped by size (one permute per size, each with its pairs' whole
    payloads): gloo sends a message only once its receiver has posted the receive, and a host
    runs its permutes in program order, so a middle stage whose incoming and outgoing payloads
    went in different permutes would relay them one after the other (the relay of
    ``docs/results/network/pipeline_model.md``); cut, the common bytes of every pair cross
    together and only the rest is relayed.
    """

    def select(stage, items, members):
        chosen = items[0]
        for i, item in zip(members[1:], items[1:]):
            source = pairs[i][0]
            chosen = jax.tree.map(lambda new, old, s=source: jnp.where(stage == s, new, old),
                                  item, chosen)  # fmt: skip
        return chosen

    def move(stage, payloads):
        structs = [jax.tree.map(_struct, p) for p in payloads]
        members = list(range(len(pairs)))
        if all(s == structs[0] for s in structs) and len(jax.tree.leaves(structs[0])) == 1:
            chosen = select(stage, payloads, members)
            got = move_as_bits(lambda x: lax.ppermute(x, _mesh.STAGE, list(pairs)), chosen)
            return (got,) * len(pairs)
        vectors = [to_bytes(p) for p in payloads]
        pieces = [[] for _ in pairs]
        for low, high, members in move_pieces([byte_size(s) for s in structs]):
            chosen = select(stage, [vectors[i][low:high] for i in members], members)
            got = lax.ppermute(chosen, _mesh.STAGE, [pairs[i] for i in members])
            for i in members:
                pieces[i].append(got)
        return tuple(
            from_bytes(jnp.concatenate(p) if p else jnp.zeros((0,), jnp.uint8), s)
            for p, s in zip(pieces, structs)
        )

    return move


def plan_here(prog: Program, local: dict, labels: Any) -> _residuals.ResidualPlan:
    """Plans the stages' saved residuals in this ``shard_map`` body (inputs varying as the
    ticks pass them), so the plan matches what the ticks' pullbacks save."""
    st, axes = prog.static, prog.axes
    params = [st.layout.unpack_stage(s, local) for s in range(prog.num_stages)]
    inputs = [_zeros(s, axes) for s in st.inputs]
    states = [_zeros(s, axes) for s in st.model_layout.structs()]
    return _residuals.plan(prog.fns, params, inputs, _take(labels, 0), states)


def run(prog: Program, local, x, labels, ids, key, states, model=None) -> Carry:
    """Runs every tick of ``prog`` on this device (inside ``shard_map``).

    Args:
      prog: the static :class:`Program`.
      local: this stage's packed parameter vectors ``{dtype: [L]}`` (varying).
      x: ``[M, mb, ...]`` inputs; labels: pytree of ``[M, mb, ...]``; ids: ``[M, mb]`` or None.
      key: PRNG key (or ``None`` for deterministic codecs).
      states: this device's packed link-state vectors ``{dtype: [L_s]}``.
      model: this device's packed running state of its stage ``{dtype: [L_m]}`` (``None``:
        the model has none).

    Returns:
      The final :class:`Carry`: ``loss`` and ``metrics`` are sums over microbatches (non-zero on
      the last stage), ``grads`` this stage's gradient, ``states`` the new link ends,
      ``model`` the stage's running state after its forwards of microbatches ``0 .. M - 1``.
    """
    st, num, axes, m_ = prog.static, prog.num_stages, prog.axes, prog.num_microbatches
    tables = _tables(prog.schedule, num, m_, prog.train)
    slots = prog.slots
    x = _local.to_varying(x, axes)
    labels = _local.to_varying(labels, axes)
    residuals, masks, grads, plan = {}, {}, {}, None
    if prog.train:
        plan = plan_here(prog, local, labels)
        rows = _schedule.write_slots(prog.schedule, num, m_)[0]
        residuals = {g: jnp.zeros((rows, n), g) for g, n in plan.layout.lengths}
        masks = {g: jnp.zeros((slots, n), g) for g, n in st.mask_layout.lengths}
        grads = {g: jnp.zeros((n,), g) for g, n in st.layout.lengths}
    outputs = None
    if prog.collect:
        outputs = jnp.zeros((m_, *st.final.shape), st.final.dtype)
    carry = Carry(
        tuple(jnp.zeros(s.shape, s.dtype) for s in st.shapes),
        tuple(jnp.zeros(s.shape, s.dtype) for s in st.shapes) if prog.train else (),
        residuals,
        masks,
        grads,
        states,
        jnp.zeros((), jnp.float32),
        jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), st.metrics),
        outputs,
        {} if model is None else model,
    )
    carry = _local.to_varying(carry, axes)

    # each stage's ops and each boundary's sends traced once, for every tick
    ops, sends = stage_ops(prog, plan), link_ops(prog)

    def tick(c, t, kinds):
        return _tick(prog, plan, ops, sends, c, t, kinds, local, x, labels, ids, key, tables)

    for seg in _schedule.segments(prog.schedule, num, m_, prog.train):
        if seg.length == seg.period:
            for j, kinds in enumerate(seg.pattern):
                carry = tick(carry, seg.start + j, kinds)
            continue

        def body(c, i, seg=seg):
            for j, kinds in enumerate(seg.pattern):
                c = tick(c, seg.start + i * seg.period + j, kinds)
            return c, None

        carry, _ = lax.scan(body, carry, jnp.arange(seg.length // seg.period, dtype=jnp.int32))
    return carry


# ----------------------------------------------------------------------------------------------
# The ops of one tick program, each traced once (see the module docstring).


class StageOps(NamedTuple):
    """One program's per-stage ops (a tuple of ``S`` callables each, ``None`` where the
    program has no such op).

    Attributes:
      forward: training forward ``(local, model, h, labels) -> (out, aux, packed residuals,
        packed new state)``; the last stage's ``out`` is its float32 loss, ``aux`` its
        metrics (``None`` for the other stages).
      backward: ``(local, model, residual row, cotangent, labels) -> (packed d params, d x)``
        (``d x`` is ``None`` for stage 0).
      evaluate: ``(local, model, h, labels) -> y`` for a hidden stage, ``(loss, metrics, y)``
        for the last one (float32 loss and metrics).
    """

    forward: tuple | None
    backward: tuple | None
    evaluate: tuple | None


def _inline(fn):
    return jax.jit(fn, inline=True)


def stage_ops(prog: Any, plan: _residuals.ResidualPlan | None) -> StageOps:
    """The ops of every stage of ``prog`` (a :class:`jaxcomp.pipeline._ticks.Program`), with
    the residual ``plan`` of a training program (``None`` for evaluation).

    Make them once per program trace: JAX's trace cache is per function object, so a tick
    that made its own would trace the stage again.
    """
    st, num, axes = prog.static, prog.num_stages, prog.axes

    def unpack(s, local, model):
        return st.layout.unpack_stage(s, local), st.model_layout.unpack_stage(s, model)

    def evaluate(s):
        fns = prog.fns[s]

        def op(local, model, h, labels):
            params, state = unpack(s, local, model)
            y = fns.stage(params, state, h)
            if s < num - 1:
                return y
            loss, metrics = _config.split_loss(prog.loss_fn(y, labels))
            metrics = jax.tree.map(lambda v: v.astype(jnp.float32), metrics)
            return loss.astype(jnp.float32), metrics, y

        return _inline(op)

    def forward(s):
        fns = prog.fns[s]

        def op(local, model, h, labels):
            params, state = unpack(s, local, model)
            out, aux, res, new_state = _residuals.forward(plan, fns, s, params, h, labels, state)
            return out, aux, res, st.model_layout.pack_stage(s, new_state)

        return _inline(op)

    def backward(s):
        fns = prog.fns[s]

        def op(local, model, res_row, ct, labels):
            params, state = unpack(s, local, model)
            like = _local.to_varying(jnp.zeros(st.inputs[s].shape, st.inputs[s].dtype), axes)
            dp, dx = _residuals.backward(plan, fns, s, params, res_row, ct, like, labels, state)
            return st.layout.pack_stage(s, dp), dx

        return _inline(op)

    stages = range(num)
    if not prog.train:
        return StageOps(None, None, tuple(evaluate(s) for s in stages))
    return StageOps(tuple(forward(s) for s in stages), tuple(backward(s) for s in stages), None)


class LinkOps(NamedTuple):
    """One program's sends, per direction and boundary, split at the move so that a tick moves
    every payload in one collective (:func:`tick_moves`).

    Attributes:
      encode: ``{"F" | "B": per boundary (S - 1) ``encode(x, states, payloads, key, ids,
        is_source, is_target) -> (payload, states)``}``: the forward's
        (:func:`jaxcomp.pipeline._links.forward_halves`, ``payloads`` unused) and the
        backward's (:func:`jaxcomp.pipeline._links.backward_halves`; ``payloads``: the
        forward's ``(sent, received)`` of the microbatch in shared-mask mode).
      decode: the same, ``decode(received, x, states, payloads, ids, is_source, is_target)
        -> (decoded, states)``.
      move: ``move(pairs) -> (stage, payloads) -> received``: one move's ``ppermute``
        (:func:`move_boundaries`), one per set of pairs.
    """

    encode: dict
    decode: dict
    move: Any


def link_ops(prog: Any) -> LinkOps:
    """The sends of every boundary of ``prog``. Make them once per program trace, as
    :func:`stage_ops`."""
    layout, compress, links = prog.static.state_layout, prog.compress, prog.links

    def op(b, direction, half):
        make = _links.forward_halves if direction == F else _links.backward_halves

        def fn(*args):
            *args, is_source, is_target = args
            if direction == F:  # the forward's halves take no shared-mask payloads
                del args[2 + half]
            return make(links[b], b, layout, (is_source, is_target), compress)[half](*args)

        return _inline(fn)

    movers = {}

    def move(pairs):
        if pairs not in movers:
            movers[pairs] = _inline(move_boundaries(pairs))
        return movers[pairs]

    bs = range(len(links))
    return LinkOps(
        {d: tuple(op(b, d, 0) for b in bs) for d in (F, B)},
        {d: tuple(op(b, d, 1) for b in bs) for d in (F, B)},
        move,
    )
