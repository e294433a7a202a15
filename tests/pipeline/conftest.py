"""Small staged models shared by the pipeline tests (built once per session)."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import pipeline
from jaxcomp.pipeline import _links

NUM_STAGES = 4


def _mlp_stage(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def _mse(y, labels):
    return jnp.mean((y - labels) ** 2)


def make_mlp(
    num_microbatches=4, microbatch=2, width=16, seed=0, num_stages=NUM_STAGES, widths=None
):
    """A homogeneous stack of tanh(x W + b) stages with an MSE loss (``widths``: the
    ``num_stages + 1`` widths of a heterogeneous one, inputs to outputs)."""
    rng = np.random.default_rng(seed)  # numpy: no per-op compiles in test setup
    widths = (width,) * (num_stages + 1) if widths is None else tuple(widths)
    params = [
        {
            "w": jnp.asarray(rng.normal(size=(i, o)) / np.sqrt(i), jnp.float32),
            "b": jnp.asarray(0.1 * rng.normal(size=(o,)), jnp.float32),
        }
        for i, o in zip(widths[:-1], widths[1:])
    ]
    n = num_microbatches * microbatch
    batch = {
        "x": jnp.asarray(rng.normal(size=(n, widths[0])), jnp.float32),
        "label": jnp.asarray(rng.normal(size=(n, widths[-1])), jnp.float32),
        "ids": jnp.arange(n, dtype=jnp.int32),
    }
    model = pipeline.StagedModel((_mlp_stage,) * num_stages, _mse)
    return types.SimpleNamespace(model=model, params=params, batch=batch, M=num_microbatches)


def _conv(p, x, stride=1):
    y = jax.lax.conv_general_dilated(
        x, p["kernel"], (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return y + p["bias"]


def _group_norm(x, groups=2, eps=1e-5):
    n, h, w, c = x.shape
    g = x.reshape(n, h, w, groups, c // groups)
    mean = g.mean(axis=(1, 2, 4), keepdims=True)
    var = g.var(axis=(1, 2, 4), keepdims=True)
    return ((g - mean) / jnp.sqrt(var + eps)).reshape(x.shape)


def _stem(p, x):  # [mb, 8, 8, 1] -> [mb, 8, 8, 4]
    return jax.nn.relu(_conv(p["conv"], x))


def _down(p, x):  # halves the resolution, changes the channels, GroupNorm
    return _group_norm(jax.nn.relu(_conv(p["conv"], x, stride=2))) * p["scale"]


def _head(p, x):  # [mb, 4, 4, 8] -> [mb, 10] (4 stages: [mb, 2, 2, 16])
    return x.mean(axis=(1, 2)) @ p["w"] + p["b"]


def _cross_entropy(logits, labels):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def make_cnn(num_microbatches=4, microbatch=2, seed=0, num_stages=4):
    """A heterogeneous CNN: channels 1 -> 4 -> 8 -> 16 -> 10 classes, resolution 8 -> 4 -> 2,
    every stage with a different parameter structure (``num_stages=3``: one ``_down`` stage,
    channels 1 -> 4 -> 8 -> 10, resolution 8 -> 4; the first, middle and last stages' three
    structures and a boundary of each size)."""
    if num_stages not in (3, 4):
        raise ValueError(f"make_cnn has 3 or 4 stages, not {num_stages}")
    rng = np.random.default_rng(seed)

    def f32(a):
        return jnp.asarray(a, jnp.float32)

    def conv(cin, cout):
        w = rng.normal(size=(3, 3, cin, cout)) / np.sqrt(9 * cin)
        return {"kernel": f32(w), "bias": jnp.full((cout,), 0.01)}

    params = [{"conv": conv(1, 4)}, {"conv": conv(4, 8), "scale": jnp.ones((8,))}]
    if num_stages == 4:
        params.append({"conv": conv(8, 16), "scale": jnp.ones((16,))})
    channels = params[-1]["scale"].shape[0]
    w = rng.normal(size=(channels, 10)) / np.sqrt(channels)
    params.append({"w": f32(w), "b": jnp.zeros((10,))})
    n = num_microbatches * microbatch
    batch = {
        "x": f32(rng.normal(size=(n, 8, 8, 1))),
        "label": jnp.asarray(rng.integers(0, 10, size=(n,)), jnp.int32),
        "ids": jnp.arange(n, dtype=jnp.int32),
    }
    stages = (_stem,) + (_down,) * (num_stages - 2) + (_head,)
    model = pipeline.StagedModel(stages, _cross_entropy)
    return types.SimpleNamespace(model=model, params=params, batch=batch, M=num_microbatches)


def unpipelined_value_and_grad(model, params, batch):
    """The reference: the stages composed on the whole batch, no pipeline, no compression.

    One jitted program (run eagerly it compiled every op of the model apart: ~260 programs,
    ~7 s of the GPT decoder test), made once per model: a module's calls on the same model
    and shapes share its compile."""
    return _reference_program(model)(params, batch["x"], batch["label"])


@functools.cache
def _reference_program(model):
    def loss(params, x, labels):
        h = x
        for f, p in zip(model.stages, params):
            h = f(p, h)
        out = model.loss_fn(h, labels)
        return out[0] if isinstance(out, tuple) else out

    return jax.jit(jax.value_and_grad(loss))


def _forward(model, params, h):
    return functools.reduce(lambda h, fp: fp[0](fp[1], h), zip(model.stages, params), h)


#: the stages composed on the whole batch (no pipeline, no loss): ``forward(model, params, x)``
forward = jax.jit(_forward, static_argnums=0)


def check_data_stage_meter(text, pipe, params, batch, mesh):
    """On a (data x stage) mesh with unpacked parameters (the step gathers the stage-sharded
    gradient: permutes of its rows towards stage 0), each direction's boundary bytes in the
    compiled ``text`` are R times one pipeline replica's compressed payloads: the program sends
    the payloads, no more, and ``_links.hlo_sent_bytes`` counts them and only them."""
    replicas = mesh.shape["data"]
    counts = pipe.bytes_per_step(params, batch, compress=True)
    sent = _links.hlo_sent_bytes(text, mesh)
    assert sent["forward"] == replicas * counts["forward_bytes"] > 0
    assert sent["backward"] == replicas * counts["backward_bytes"] > 0
    assert counts["wire_bytes"] < counts["dense_bytes"]
    # the premise (what the meter once counted as backward sends): the other permutes are the
    # gather of stages 1 .. S - 1's gradient rows (f32) to stage 0, in each replica
    row = np.dtype(np.float32).itemsize * sum(p.size for p in jax.tree.leaves(params[0]))
    assert sent["other"] == (mesh.shape["stage"] - 1) * replicas * row


def check_unpipelined(fx, loss, grads, metrics):
    """A dense pipeline step's ``loss``, ``grads`` (packed) and ``metrics["accuracy"]`` are the
    unpipelined model's on ``fx`` (a :func:`make_mlp` or :func:`make_cnn` namespace).

    Returns:
      The reference's ``(loss, outputs, accuracy)``, for a test's further checks."""
    ref_loss, ref_grads = unpipelined_value_and_grad(fx.model, fx.params, fx.batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(grads.unpack(), ref_grads)
    h = forward(fx.model, fx.params, fx.batch["x"])
    accuracy = np.mean(np.argmax(np.asarray(h), -1) == np.asarray(fx.batch["label"]))
    np.testing.assert_allclose(metrics["accuracy"], accuracy, rtol=1e-6)
    return ref_loss, h, accuracy


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert len(la) == len(lb), (ta, tb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.fixture(autouse=True, scope="module")
def _fast_compiles(fast_compiles):
    """These tests compile many small programs; XLA's optimisation passes would dominate: the
    root conftest's ``fast_compiles`` for every module here. Module-scoped: this directory has
    no ``__init__.py``, and a ``scope="package"`` fixture here was torn down only at the end of
    the session, so every later test of the same worker ran unoptimised (until 2026-12-02)."""
    del fast_compiles
    yield


@pytest.fixture(scope="session")
def stage_mesh():
    """4 of the 8 fake devices, one per stage."""
    return pipeline.pipeline_mesh(NUM_STAGES, jax.devices()[:NUM_STAGES])


@pytest.fixture(scope="session")
def stage_mesh3():
    """3 of the 8 fake devices, one per stage of :func:`mlp3` and :func:`cnn`."""
    return pipeline.pipeline_mesh(3, jax.devices()[:3])


@pytest.fixture(scope="session")
def pack(stage_mesh):
    def pack_fn(params, mesh=stage_mesh):
        return pipeline.pack_params(params, NamedSharding(mesh, P("stage")))

    return pack_fn


@pytest.fixture(scope="session")
def mlp():
    return make_mlp()


@pytest.fixture(scope="session")
def mlp3():
    """The smallest pipeline with every stage role (a first, a middle and a last stage) and
    the most bubble ticks (``M = S = 3``; the recorded numbers' MLP too): its step has fewer
    unrolled fill and drain ticks and fewer stages per tick's switch, and compiles in about
    half the 4-stage step's time."""
    return make_mlp(num_microbatches=3, num_stages=3)


@pytest.fixture(scope="session")
def cnn():
    """The 3-stage CNN (3 microbatches of 2 rows), on :func:`stage_mesh3`."""
    return make_cnn(num_microbatches=3, num_stages=3)


@pytest.fixture(scope="session")
def tools():
    """Helpers for test modules (conftest functions are not importable with importlib mode)."""
    return types.SimpleNamespace(
        make_mlp=make_mlp,
        make_cnn=make_cnn,
        reference=unpipelined_value_and_grad,
        forward=forward,
        close=assert_trees_close,
        check_unpipelined=check_unpipelined,
        check_data_stage_meter=check_data_stage_meter,
    )


def _live_ends(states, replica):
    """The live ends of every link (boundary order, forward then backward, sender then
    receiver) as numpy arrays: the order ``_golden.py`` recorded them in."""
    out = []
    for st in states.ends(replica):
        for ends in (st.forward, st.backward):
            out += [np.asarray(a) for a in jax.tree.leaves(ends.send)]
            out += [np.asarray(a) for a in jax.tree.leaves(ends.recv)]
    return out


@pytest.fixture(scope="session")
def recorded(load_test_module):
    """The numbers ``_golden.py`` recorded (``golden_v1.npz``): ``recorded.check(case, step, loss,
    grads, states, replicas)`` compares a step of a case with them. test_golden.py runs the
    cases no other test runs; test_compressed.py checks its runs of the same link, schedule and
    MLP here too (each case's programs compiled once)."""
    with np.load(load_test_module("pipeline/_golden.py").GOLDEN) as f:
        recorded = dict(f)

    def check(case, step, loss, grads, states, replicas=1):
        prefix = f"{case}/{step}"
        np.testing.assert_allclose(loss, recorded[f"{prefix}/loss"], rtol=1e-5)
        for j, g in enumerate(jax.tree.leaves(grads.unpack())):
            np.testing.assert_allclose(g, recorded[f"{prefix}/grad/{j}"], rtol=1e-5, atol=1e-6)
        for r in range(replicas):
            got = _live_ends(states, r if replicas > 1 else None)
            want = [recorded[k] for k in sorted(
                (k for k in recorded if k.startswith(f"{prefix}/ends/{r}/")),
                key=lambda k: int(k.rsplit("/", 1)[1]),
            )]  # fmt: skip
            assert len(got) == len(want), (case, step, r)
            for a, b in zip(got, want):
                assert a.shape == b.shape and a.dtype == b.dtype
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    return types.SimpleNamespace(check=check)
