"""Error-feedback invariants across steps, in both directions; bubble ticks touch no state.

A probe pipeline whose gradients reveal what crossed each boundary: stages 0 and 1 (a first and
a middle stage) add a parameter (``y = x + v_b``), stage 2 multiplies (``y = x * w``), loss
``mean_m sum(y_m)``. Then ``dL/dv_b = sum_m g_hat_b,m`` (the gradient stage ``b`` received over
backward link ``b``) and ``dL/dw = sum_m x_hat_1,m / M``, so the EF telescoping identity
``sum_m sent + e = sum_m received + e'`` can be checked per backward link and, summed over the
links, forward.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import compressors as C
from jaxcomp import feedback as F
from jaxcomp import pipeline

S, M, MB, D, STEPS = 3, 3, 2, 8, 3


def _add(p, x):
    return x + p["v"]


def _mul(p, x):
    return x * p["w"]


def _total(y, labels):
    del labels
    return jnp.sum(y)  # the pipeline takes the mean over the M microbatches


@pytest.fixture(scope="module")
def probe(stage_mesh3, pack):
    stage_mesh = stage_mesh3
    rng = np.random.default_rng(0)
    params = [{"v": jnp.asarray(rng.normal(size=(MB, D)), jnp.float32)} for _ in range(S - 1)]
    params.append({"w": jnp.asarray(rng.normal(size=(MB, D)), jnp.float32)})
    batches = [
        {"x": jnp.asarray(rng.normal(size=(M * MB, D)), jnp.float32), "y": jnp.zeros(M * MB)}
        for _ in range(STEPS)
    ]
    link = pipeline.link(
        F.error_feedback(C.top_k(count=3, per_sample=True)), F.error_feedback(C.quantize(3))
    )
    model = pipeline.StagedModel((_add,) * (S - 1) + (_mul,), _total)
    pipe = pipeline.distribute(model, pipeline.PipelineConfig(M, link), stage_mesh)
    packed = pack(params, stage_mesh)
    states = [pipe.init(packed, batches[0])]
    grads = []
    step = jax.jit(pipe.step)
    for i, batch in enumerate(batches):
        _, g, new, _ = step(packed, batch, states[-1], jax.random.key(i))
        grads.append(g.unpack())
        states.append(new)
    return params, batches, grads, states


def _np(tree):
    return jax.tree.map(np.asarray, tree)


def test_backward_error_feedback_telescopes_per_link(probe):
    params, _, grads, states = probe
    w = np.asarray(params[-1]["w"])
    for i in range(STEPS):
        g = _np(grads[i])
        old, new = states[i].ends(), states[i + 1].ends()
        # what each backward link sent, summed over microbatches: w / M per microbatch from
        # the last stage, then what the stage above received
        sent = [g[b + 1]["v"] for b in range(S - 2)] + [M * (w / M)]
        for b in range(S - 1):
            e_old = np.asarray(old[b].backward.send.residual)
            e_new = np.asarray(new[b].backward.send.residual)
            assert np.any(e_new != e_old)
            np.testing.assert_allclose(sent[b] + e_old, g[b]["v"] + e_new, rtol=1e-5, atol=1e-5)


def test_forward_error_feedback_telescopes_over_the_links(probe):
    params, batches, grads, states = probe
    v = sum(np.asarray(p["v"]) for p in params[:-1])
    for i in range(STEPS):
        x = np.asarray(batches[i]["x"]).reshape(M, MB, D).sum(axis=0)
        old, new = states[i].ends(), states[i + 1].ends()
        e_old = sum(np.asarray(old[b].forward.send.residual) for b in range(S - 1))
        e_new = sum(np.asarray(new[b].forward.send.residual) for b in range(S - 1))
        received_last = M * np.asarray(grads[i][-1]["w"])  # sum_m x_hat_(S-2),m
        np.testing.assert_allclose(x + M * v + e_old, received_last + e_new, rtol=1e-5, atol=1e-5)


def test_only_the_link_ends_ever_change(probe):
    """Bubble ticks send nothing, and a device touches only the ends it owns: each device's
    packed row changes in its own ends (every sender's residual) and never in its padding."""
    *_, states = probe
    initial, final = states[0], states[-1]
    layout = initial.layout
    for name, shape, _ in layout.buffers:
        a0, a1 = np.asarray(initial.buffers[name]), np.asarray(final.buffers[name])
        for d in range(S):
            used = sum(p.size for p in layout.places[d] if p.buffer == name)
            np.testing.assert_array_equal(a0[d][..., used:], a1[d][..., used:])
            assert used < shape[-1] or 0 < d < S - 1  # the end stages own fewer ends
    for b, (e0, e1) in enumerate(zip(initial.ends(), final.ends())):
        for direction in ("forward", "backward"):
            s0, s1 = getattr(e0, direction).send, getattr(e1, direction).send
            assert np.any(np.asarray(s0.residual) != np.asarray(s1.residual)), (b, direction)
