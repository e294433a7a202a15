"""The cost model plays a pipeline step's real permutes (``jaxcomp.study._moves``): per move (a
tick's sends, both directions in one under 1F1B) one ``collective-permute`` per distinct payload
size, with the bytes each pair carries, as the compiled tick program has them; and the lab's
prediction plays those permutes, not one move of the mean send."""

import collections
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors as C
from jaxcomp import pipeline
from jaxcomp.pipeline import _links
from jaxcomp.study import _cost
from jaxcomp.study import _moves
from jaxcomp.study import _network
from jaxcomp.study import _pipeline_model

pytestmark = pytest.mark.usefixtures("fast_compiles")

#: inputs, the three boundaries (24, 8 and 12 float32 per row), outputs
WIDTHS = (16, 24, 8, 12, 16)
M, ROWS = 4, 2
#: a different codec on each boundary: identity, 8-bit both ways, 4-bit forward / dense back
LINKS = (
    pipeline.link(),
    pipeline.link(C.quantize(8), C.quantize(8)),
    pipeline.link(C.quantize(4), None),
)


def _stage(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def _mse(y, labels):
    return jnp.mean((y - labels) ** 2)


@functools.cache
def _hlo(schedule: str, train: bool) -> str:
    rng = np.random.default_rng(0)
    params = [{"w": jnp.asarray(rng.normal(size=(i, o)) / np.sqrt(i), jnp.float32),
               "b": jnp.zeros((o,), jnp.float32)}
              for i, o in zip(WIDTHS[:-1], WIDTHS[1:])]  # fmt: skip
    rows = M * ROWS
    batch = {"x": jnp.asarray(rng.normal(size=(rows, WIDTHS[0])), jnp.float32),
             "label": jnp.asarray(rng.normal(size=(rows, WIDTHS[-1])), jnp.float32)}  # fmt: skip
    model = pipeline.StagedModel((_stage,) * 4, _mse)
    mesh = pipeline.pipeline_mesh(4, jax.devices()[:4])
    config = pipeline.PipelineConfig(M, LINKS, schedule=schedule)
    pipe = pipeline.distribute(model, config, mesh)
    packed = pipeline.pack_params(params, NamedSharding(mesh, P("stage")))
    if not train:
        fn = jax.jit(pipe.evaluate, static_argnames="compress")
        return fn.lower(packed, batch, compress=True).compile().as_text()
    states = pipe.init(packed, batch)
    return jax.jit(pipe.step).lower(packed, batch, states, None).compile().as_text()


def _payloads(train: bool) -> list[tuple[int, int]]:
    shapes = [jax.ShapeDtypeStruct((ROWS, w), np.float32) for w in WIDTHS[1:-1]]
    return [
        _links.link_bytes(lk if train else _links.eval_links([lk])[0], s, True)
        for lk, s in zip(LINKS, shapes)
    ]


def _recorded(text: str) -> list[dict]:
    return [
        {"bytes_per_execution": r.bytes_per_execution, "pairs": [list(p) for p in r.pairs],
         "executions": r.executions}
        for r in comm.collective_report(text).records if r.kind == "collective-permute"
    ]  # fmt: skip


def _counts(permutes) -> collections.Counter:
    out = collections.Counter()
    for p in permutes:
        out[p.nbytes, tuple(sorted(p.pairs))] += 1
    return out


@pytest.mark.parametrize("schedule, train", [("gpipe", True), ("1f1b", True), ("gpipe", False)])
def test_the_played_permutes_are_the_compiled_steps(schedule, train):
    """Boundaries of 24, 8 and 12 floats per row with three different codecs: every permute
    the model plays (its pairs and the bytes each pair carries) is one of the compiled step, as
    many times (evaluation: the forward ticks, one table for either schedule)."""
    sizes = _payloads(train)
    assert len({f for f, _ in sizes}) == 3 and (not train or len({b for _, b in sizes}) == 3)
    moves = _moves.pipeline_moves(schedule, 4, M, sizes, train=train)
    played = [p for move in moves for p in move]
    assert any(len(move) > 1 for move in moves)  # a move cut at two sizes or more
    text = _hlo(schedule, train)
    hlo = collections.Counter()
    for r in comm.collective_report(text).records:
        if r.kind == "collective-permute":
            hlo[r.bytes_per_execution, tuple(sorted(r.pairs))] += r.executions
    assert _counts(played) == hlo
    sent = _links.hlo_sent_bytes(text, pipeline.pipeline_mesh(4, jax.devices()[:4]))
    assert len(played) == sent["permutes"]
    assert sum(p.nbytes * len(p.pairs) for p in played) == sent["total"]
    # and back: the boundaries' payloads read from the compiled step's permutes
    assert _moves.boundary_payloads(_recorded(text), 4, M) == [
        (f, b if train else 0) for f, b in sizes
    ]


def test_a_move_of_different_sizes_is_played_as_its_pieces():
    """S = 3, M = 2, GPipe, forward payloads 1,000 and 3,000 bytes, backward 500 and 500: the
    forward tick where both boundaries send is two permutes, (0,1) and (1,2) with 1,000 bytes
    each (a chain: stage 1 receives and sends), then (1,2) with the other 2,000; the mean
    model played it as one move of 1,250 bytes."""
    link = _cost.NetworkLink(bandwidth=1e6, latency=1e-4)
    sizes = [(1000, 500), (3000, 500)]
    moves = _moves.pipeline_moves("gpipe", 3, 2, sizes)
    assert [[(p.pairs, p.nbytes) for p in move] for move in moves] == [
        [(((0, 1),), 1000)],
        [(((0, 1), (1, 2)), 1000), (((1, 2),), 2000)],
        [(((1, 2),), 3000)],
        [(((2, 1),), 500)],
        [(((1, 0), (2, 1)), 500)],
        [(((1, 0),), 500)],
    ]
    one = [link.latency + n / link.bandwidth for n in (1000, 1000, 2000, 3000, 500, 500, 500)]
    assert _pipeline_model.pipeline_send_s("gpipe", 3, 2, sizes, link) == pytest.approx(sum(one))
    chain = _pipeline_model.pipeline_send_s("gpipe", 3, 2, sizes, link, chain_s=lambda n: n * 1e-6)
    # the chains: 1,000 bytes ahead of stage 1's go-ahead forward, 500 backward
    assert chain == pytest.approx(sum(one) + 1e-3 + 5e-4)
    assert _pipeline_model.pipeline_send_s("gpipe", 3, 2, 1250.0, link) == pytest.approx(
        6 * link.latency + 4 * 1250 / 1e6 + 2 * 1250 / 1e6
    )


def test_boundary_payloads_are_read_only_from_a_stage_only_mesh():
    """Pairs that are not neighbouring stages of a stage-only mesh (a data axis numbers its
    devices past the stages) give no payloads."""
    rec = {"bytes_per_execution": 64.0, "executions": 4}
    assert _moves.boundary_payloads([rec | {"pairs": [[0, 1]]}], 2, 4) == [(64, 0)]
    assert _moves.boundary_payloads([rec | {"pairs": [[4, 5]]}], 4, 4) is None
    assert _moves.boundary_payloads([rec | {"pairs": [[0, 2]]}], 4, 4) is None


def test_the_lab_prediction_plays_the_recorded_permutes(tmp_path):
    """A lab run whose summary records its step's permutes is priced on its boundaries' own
    payloads: here forward 4,608 and backward 8,196 bytes (the digits pipeline's quantize 4 /
    quantize 8), not their mean; permutes that are not the played moves give no prediction."""
    sizes = [(4608, 8196)] * 3
    moves = _moves.pipeline_moves("gpipe", 4, 4, sizes)
    permutes = [{"bytes_per_execution": float(p.nbytes), "pairs": [list(x) for x in p.pairs],
                 "executions": 1} for move in moves for p in move]  # fmt: skip
    w = tmp_path / "p"
    w.mkdir()
    total = 4 * 3 * (4608 + 8196)
    summary = {"mode": "pipeline", "stages": 4, "microbatches": 4, "schedule": "gpipe",
               "boundary_bytes_per_step": float(total), "hlo_collective_bytes_per_step":
               float(total), "wire_bytes_per_step": float(total), "permutes_per_step": 12,
               "boundary_permutes": permutes}  # fmt: skip
    (w / "summary.json").write_text(json.dumps(summary))
    (w / "experiment.json").write_text(json.dumps({"mesh": [["stage", 4]]}))
    (w / "timing.jsonl").write_text(json.dumps({"step": 3, "step_s": 0.1, "elapsed_s": 1}) + "\n")
    fits = {"all-reduce": {"alpha_s": 1e-4, "beta_bytes_s": 1e7, "beta_bit_s": 8e7}}
    lab = {"name": "p", "network": {"topology": "per_host", "hosts": 4, "devices_per_host": 1,
           "rate": "100mbit", "rate_bit_s": 1e8}, "calibration": {"fits": fits}}  # fmt: skip
    (w / _network.LAB_FILE).write_text(json.dumps(lab))
    record = _network.read_lab_run(str(w))
    assert record["measured"]["pipeline"]["payload_bytes"] == sizes
    link = _cost.NetworkLink(1e7, 1e-4)
    comm_s, why = _network._comm(record)
    assert why == "" and comm_s == pytest.approx(
        _pipeline_model.pipeline_send_s("gpipe", 4, 4, sizes, link)
    )
    assert comm_s == pytest.approx(6 * (1e-4 + 4608 / 1e7) + 6 * (1e-4 + 8196 / 1e7))
    summary["boundary_permutes"] = permutes[1:]  # one permute missing
    (w / "summary.json").write_text(json.dumps(summary))
    comm_s, why = _network._comm(_network.read_lab_run(str(w)))
    assert comm_s is None and "permutes" in why


def test_a_swap_pays_no_chain_and_a_chain_does():
    """Both directions of one pair in one permute start together (each go-ahead leaves before
    any data); a receiver that sends on to a third host delays its sender by ``chain_s``."""
    link = _cost.NetworkLink(bandwidth=1e6, latency=0.0)
    swap = (_moves.Permute(((0, 1), (1, 0)), 1e4),)
    chain = (_moves.Permute(((0, 1), (1, 2)), 1e4),)
    assert _pipeline_model.play_permutes([swap], 3, link, chain_s=1.0) == pytest.approx(0.01)
    assert _pipeline_model.play_permutes([chain], 3, link, chain_s=1.0) == pytest.approx(1.01)
