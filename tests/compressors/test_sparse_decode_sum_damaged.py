"""A receiver's fused ``decode_sum`` of TopK payloads drops what ``decompress`` drops.

``decompress`` and ``add_decoded`` drop an index past its block (or past the row, exact per
sample): a damaged payload. ``decode_sum`` (every all_gather receiver) must give the sum of
``decompress`` of the same payloads, not put such a value into the next block or sample.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import compressors

# where a damaged index lands, two programs of this module's compile setting compared: XLA
# optimisations off (suite speed)
pytestmark = pytest.mark.usefixtures("fast_compiles")

CASES = [
    # (codec, shape, (payload row, payload entry, the bad index))
    (compressors.top_k(count=10, method="blockwise"), (99,), (0, 0, 15)),  # block 0 -> 1
    (compressors.top_k(count=10, method="blockwise"), (99,), (0, 9, 9)),  # last block: 9 long
    (compressors.top_k(0.2, per_sample=True), (3, 20), (0, 1, 23)),  # past row 0 -> row 1
    (
        compressors.top_k(0.1, per_sample=True, method="blockwise", block_size=25),
        (2, 100),
        (0, 0, 30),  # block 0 of row 0 -> block 1
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("codec,shape,bad", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_decode_sum_drops_an_index_past_its_block_as_decompress_does(codec, shape, bad):
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    compress = jax.jit(lambda x: codec.compress(x, codec.init(x), None)[0])
    good, other = compress(x), compress(-2 * x)
    idx = np.asarray(good.indices).copy()
    flat = idx.reshape(shape[0], -1) if idx.ndim > 1 else idx.reshape(1, -1)
    flat[bad[:2]] = bad[2]  # an index of its own dtype, beyond its block or row
    damaged = good._replace(indices=jnp.asarray(idx))

    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), damaged, other)
    want = jax.jit(lambda p, q, x: codec.decompress(p, x) + codec.decompress(q, x))(
        damaged, other, x
    )
    got = jax.jit(lambda s, x: compressors.decode_sum(codec, s, x))(stacked, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
