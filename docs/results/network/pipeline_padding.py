"""Permutes and HLO-metered boundary bytes per pipeline step (pipeline_model.md, last section).

    tools/cpu-slot env PYTHONPATH=REPO python docs/results/network/pipeline_padding.py REPO

``REPO``: the tree whose ``jaxcomp`` and ``tests/pipeline/conftest.py`` are used (run once for
the tree before a change, once after). The test CNN (boundaries of different sizes): permutes,
the bytes of every pair of every permute and the payloads' sum; the test MLP (boundaries
alike): permutes and a hash of the step's StableHLO (the same program before and after).
Compiles only, 4 fake CPU devices; one JSON line per case.
"""

import hashlib
import importlib.util
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcomp import compressors as C  # noqa: E402
from jaxcomp import feedback as F  # noqa: E402
from jaxcomp import pipeline  # noqa: E402
from jaxcomp.pipeline import _links  # noqa: E402


def main(repo):
    spec = importlib.util.spec_from_file_location("c", f"{repo}/tests/pipeline/conftest.py")
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    mesh = pipeline.pipeline_mesh(4, jax.devices()[:4])
    cases = [
        ("cnn", "identity", pipeline.link()),
        ("cnn", "aq_sgd_q4/q8", pipeline.link(F.aq_sgd(C.quantize(4), 8), C.quantize(8))),
        ("mlp", "identity", pipeline.link()),
        ("mlp", "quantize8", pipeline.link(C.quantize(8), C.quantize(8))),
    ]
    for model, name, lk in cases:
        fx = fixtures.make_cnn() if model == "cnn" else fixtures.make_mlp()
        for schedule in ("gpipe", "1f1b"):
            config = pipeline.PipelineConfig(fx.M, lk, schedule=schedule)
            pipe = pipeline.distribute(fx.model, config, mesh)
            params = pipeline.pack_params(fx.params, NamedSharding(mesh, P("stage")))
            states = pipe.init(params, fx.batch)
            lowered = jax.jit(pipe.step).lower(params, fx.batch, states, jax.random.key(0))
            sent = _links.hlo_sent_bytes(lowered.compile().as_text(), mesh)
            mb = fx.batch["x"].shape[0] // fx.M
            x, y = fx.batch["x"][:mb], fx.batch["label"][:mb]
            shapes, _ = _links.boundary_shapes(fx.model, fx.params, x, y)
            payloads = fx.M * sum(sum(_links.link_bytes(lk, s, True)) for s in shapes)
            row = {"model": model, "link": name, "schedule": schedule,
                   "permutes": sent["permutes"], "hlo_bytes": sent["total"],
                   "payload_bytes": payloads,
                   "padding": f"{100 * (sent['total'] / payloads - 1):.1f}%"}  # fmt: skip
            if model == "mlp":
                ir = lowered.as_text(debug_info=False)
                row["stablehlo_sha1"] = hashlib.sha1(ir.encode()).hexdigest()[:12]
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
