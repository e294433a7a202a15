"""The optax transform's step-kind ``switch``: the SVD in its re-factorisation branch must not
lay the whole state out column-major (XLA:CPU then copied the dense moments into column-major
and back on every step), and taking LAPACK's operand from ``w @ I`` must not change the SVD."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import models
from jaxcomp import parallel
from jaxcomp import transforms
from jaxcomp.ab import _factor as F
from jaxcomp.train import _mode


def _matrices():
    rng = np.random.default_rng(3)
    g = rng.standard_normal((24, 9)).astype(np.float32)
    low = (rng.standard_normal((24, 2)) @ rng.standard_normal((2, 9))).astype(np.float32)
    signed_zeros = g.copy()
    signed_zeros[:, 4] = -0.0  # a dead unit: a column of negative zeros
    signed_zeros[3, :] = -0.0
    return {
        "gaussian": g,
        "rank_2": low,
        "tiny": g * np.float32(1e-10),
        "huge": g * np.float32(1e6),
        "zeros": np.zeros((24, 9), np.float32),
        "negative_zeros": np.full((24, 9), -0.0, np.float32),
        "signed_zero_column_and_row": signed_zeros,
        "square": rng.standard_normal((16, 16)).astype(np.float32),
    }


#: one program per form and shape for every case (a lambda jitted per case compiled both SVDs
#: again for each of the 11 cases: 22 compiles of 4 programs)
_plain_svd = jax.jit(F.svd)
_branch_svd = jax.jit(functools.partial(F.svd, in_branch=True))


@pytest.mark.user_numerics
@pytest.mark.parametrize("name", list(_matrices()))
def test_the_svd_of_a_branch_is_bit_identical_to_the_plain_svd(name):
    w = jnp.asarray(_matrices()[name])
    plain, branch = _plain_svd(w), _branch_svd(w)
    for want, got in zip(plain, branch, strict=True):
        want, got = np.asarray(want), np.asarray(got)
        np.testing.assert_array_equal(got, want)  # equal values (-0 == +0)
        if not np.any(np.signbit(_matrices()[name]) & (_matrices()[name] == 0)):
            # bit for bit, the sign of every zero included, unless the input holds a -0
            # (w @ I makes it +0: an all -0 matrix then has singular values +0, not -0)
            np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_weight_gives_a_non_finite_svd_in_a_branch_too(bad):
    w = _matrices()["gaussian"].copy()
    w[5, 2] = bad
    plain, branch = _plain_svd(jnp.asarray(w)), _branch_svd(jnp.asarray(w))
    # the harness reports a re-factorisation whose factors are not finite (the step is then
    # discarded): both must be caught, whatever LAPACK makes of the non-finite entry
    assert not all(np.isfinite(np.asarray(x)).all() for x in plain)
    assert not all(np.isfinite(np.asarray(x)).all() for x in branch)


def _column_major_copies(hlo: str, shape: str) -> list[str]:
    """Copies (``copy`` or a copy fusion) into a column-major ``shape`` outside fusions."""
    fused = set(re.findall(r"kind=k\w+, calls=(%[\w.\-]+)", hlo))
    found = []
    for comp in re.split(r"\n(?=\S)", hlo):
        name = re.match(r"(?:ENTRY )?(%[\w.\-]+)", comp)
        if not name or name.group(1) in fused:
            continue
        target = re.escape(f"f32[{shape}]{{0,1}}")
        found += re.findall(rf"(%[\w.\-]*copy[\w.\-]*) = {target} ", comp)
    return found


@pytest.mark.slow
def test_the_transform_switch_keeps_the_dense_moments_row_major():
    """Compiled on CPU (the digits MLP of ``configs/digits_ab.py``), no branch copies a dense
    moment or a factorised weight into column-major: only LAPACK's operands are (one per
    factorised weight and SVD). Before, every branch copied the four dense Adam moments into
    column-major and the root copied them back, on every step (24 such copies for 6 SVDs)."""
    mesh = parallel.ab_mesh(2, jax.devices()[:4])
    config = transforms.ABConfig(1e-3, warmup_steps=2, sync_every=4, full_rank_steps=1,
                                 exclude=("fc1", "head"), max_rank_fraction=0.25)  # fmt: skip
    tx = transforms.ab_transform(config)
    model = models.get_model("mlp", hidden=(256, 256, 256))
    params = tuple(v["params"] for v in _mode.jit_init(model.init)(jax.random.key(0)))

    def loss_fn(p, batch):
        logits, _ = model.apply(tuple({"params": x} for x in p), batch["x"], train=True)
        return model.loss_fn(logits, batch["label"])

    axes, held = config.axis_name, config.state_axes(mesh)

    def body(p, o, batch):
        p, o = jax.tree.map(lambda a: a[0], (p, o))
        _, g = comm.local_value_and_grad(loss_fn, axes)(p, batch)
        u, o = tx.update(g, o, p)
        return jax.tree.map(lambda a: a[None], (optax.apply_updates(p, u), o))

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(held), P(held), P(axes)),
                               out_specs=(P(held), P(held))))  # fmt: skip
    p, o = parallel.stack_per_worker((params, tx.init(params)), mesh, held)
    batch = {"x": jnp.ones((16, *model.input_shape)), "label": jnp.zeros(16, jnp.int32)}
    text = fn.lower(p, o, batch).compile().as_text()
    svds = len(re.findall(r"custom_call_target=\"lapack_\w*gesdd", text))
    assert svds >= 2  # the re-factorisation and the first factorisation are in the program
    copies = _column_major_copies(text, "256,256")
    assert len(copies) <= svds, f"{len(copies)} column-major copies for {svds} SVDs: {copies}"
    # the A factors' moments, aligned in the re-factorisation branch: a gather of columns
    # made them column-major and every branch copied its pass-through ones (20 copies)
    assert not _column_major_copies(text, "256,64")
