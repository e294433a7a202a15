"""Collectives per data-parallel step in the compiled HLO (issue 33 item 4; README section).

    tools/cpu-slot env PYTHONPATH=. python docs/results/network/collectives_per_step.py

The digits MLP's shapes and configs/text_gpt_dense.py's GPT, dense / PowerSGD r2 + EF /
Accordion through ``parallel.data_parallel`` on 8 fake CPU devices; a loss whose gradient has
every leaf's shape (what is counted depends on the shapes only).
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcomp import comm  # noqa: E402
from jaxcomp import compressors  # noqa: E402
from jaxcomp import feedback  # noqa: E402
from jaxcomp import models  # noqa: E402
from jaxcomp import parallel  # noqa: E402
from jaxcomp import transforms  # noqa: E402

MLP = (64, 256, 256, 256, 10)


def trees():
    rng = np.random.default_rng(0)
    mlp = {
        f"w{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(zip(MLP, MLP[1:]))
    }
    mlp |= {f"b{i}": np.zeros(b, np.float32) for i, b in enumerate(MLP[1:])}
    gpt = models.get_model("gpt", vocab_size=256, seq_len=32, dim=64, num_blocks=4, num_heads=4,
                           cuts=("block0", "block1", "block2")).init(jax.random.key(0))  # fmt: skip
    return {"digits MLP": jax.tree.map(jnp.asarray, mlp), "GPT": gpt}


def transforms_():
    return {
        "dense": transforms.compressed_mean(feedback.plain(compressors.identity())),
        "powersgd-r2-ef": transforms.compressed_mean(
            feedback.error_feedback(compressors.power_sgd(2))
        ),
        "accordion": transforms.accordion(
            compressors.power_sgd(2), compressors.power_sgd(1), interval_steps=11, check_every=2
        ),
    }


def main():
    mesh = comm.make_mesh([("data", 8)])
    x = jax.device_put(jnp.ones((64, 8)), NamedSharding(mesh, P("data")))

    def loss_fn(p, b):
        return sum(jnp.sum(leaf * jnp.mean(b)) ** 2 for leaf in jax.tree.leaves(p))

    for model, params in trees().items():
        for name, tx in transforms_().items():
            dp = parallel.data_parallel(loss_fn, optax.chain(tx, optax.sgd(0.05)), mesh)
            report = comm.measure_collectives(dp.step, dp.init(params), x)
            print(f"{model}: {name}: {len(report.records)} collectives, "
                  f"{report.total_bytes:.0f} bytes/device")  # fmt: skip


if __name__ == "__main__":
    main()
