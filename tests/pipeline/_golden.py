"""Numbers of the pipeline before the compact link-state layout.

``golden_v1.npz`` holds what the GPipe pipeline of commit 48750c7 (link states with one slot
per stage, backward by autodiff) computed on the cases below, on 3-stage pipelines (a first, a
middle and a last stage: every role a link end has): loss, gradients and the *live* ends of
every link state (boundary ``b``: forward sender ``b``, receiver ``b + 1``; backward sender
``b + 1``, receiver ``b``). ``test_golden.py`` runs today's pipeline on the same cases and
compares. Every case's backward channel is stateless or keyed by sample id, so its numbers do
not depend on the order in which a step's microbatches cross a boundary backward (that order
changed: microbatch order now, reversed before).

Recorded (2026-12-06; at 4 stages before) with that pipeline on the rest of the package of
e5e03b5, the last commit the old pipeline imports with::

  python tests/pipeline/_golden.py record --old-pipeline 48750c7 --package e5e03b5

(the pipeline package of the first commit, everything else from the second; without
``--package``, from the working tree). The same command at 4 stages rewrote the 4-stage file
of e5e03b5 bit for bit, which today's pipeline matched: these cases' codecs compute as they
did there. When a codec's numerics change, record with today's codecs (no ``--package``): the
old pipeline then needs the helpers it imports (``compressors._base``, ``comm``, ``feedback``)
as they were at e5e03b5.
"""

import importlib.util
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).parent
GOLDEN = HERE / "golden_v1.npz"
S = 3  # stages
N = 6  # samples per batch (per-sample buffers)


def conftest():
    spec = importlib.util.spec_from_file_location("_pipeline_conftest", HERE / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cases():
    """name -> (fixture kind, link, compress per step, data replicas)."""
    from jaxcomp import compressors as C
    from jaxcomp import feedback as F
    from jaxcomp import pipeline

    topk_ef = pipeline.link(
        F.error_feedback(C.top_k(0.25, per_sample=True)),
        F.error_feedback(C.top_k(0.5), num_samples=N),
    )
    aq = pipeline.link(F.aq_sgd(C.quantize(4), N), F.error_feedback(C.top_k(0.5), num_samples=N))
    quant = pipeline.link(C.quantize(4, scale="feature"), C.quantize(4, rounding="stochastic"))
    cnn_aq = pipeline.link(F.aq_sgd(C.quantize(4), N), C.quantize(8))
    return {
        "topk_ef": ("mlp", topk_ef, (True, True, True), 1),
        "ef21_q8": ("mlp", pipeline.link(F.ef21(C.top_k(0.25)), C.quantize(8)), (True,) * 3, 1),
        "aq_sgd": ("mlp", aq, (False, True, True), 1),
        "shared_mask": (
            "mlp", pipeline.link(C.top_k(0.25, per_sample=True), mode="shared_mask"),
            (True, True), 1,
        ),
        "quant_stochastic": ("mlp", quant, (True, True), 1),
        "cnn_aq": ("cnn", cnn_aq, (False, True), 1),
        "replicas_topk_ef": ("mlp2", topk_ef, (True, True), 2),
    }  # fmt: skip


def fixture(kind):
    c = conftest()
    if kind == "cnn":
        return c.make_cnn(num_microbatches=S, num_stages=S)
    # "mlp2": the same 6 rows as 2 replicas x 3 microbatches x 1 row
    return c.make_mlp(num_microbatches=S, num_stages=S)


def old_ends(states):
    """The live ends of the old layout's states, as numpy arrays in a flat list."""
    import jax

    out = []
    for b, st in enumerate(states):
        for direction, (send, recv) in (("forward", (b, b + 1)), ("backward", (b + 1, b))):
            ends = getattr(st, direction)
            for end, slot in (("send", send), ("recv", recv)):
                out += [np.asarray(a[slot]) for a in jax.tree.leaves(getattr(ends, end))]
    return out


def record():
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcomp import pipeline

    jax.config.update("jax_disable_most_optimizations", True)  # as the pipeline tests run
    arrays = {}
    for name, (kind, link, schedule, replicas) in cases().items():
        fx = fixture(kind)
        mesh = pipeline.pipeline_mesh(S, jax.devices()[: S * replicas])
        distribute = getattr(pipeline, "distribute", None) or pipeline.gpipe  # 48750c7: gpipe
        pipe = distribute(fx.model, pipeline.PipelineConfig(fx.M, link), mesh)
        params = pipeline.pack_params(fx.params, NamedSharding(mesh, P("stage")))
        batch = fx.batch
        if replicas > 1:
            batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        states = pipe.init(params, batch)
        step = jax.jit(pipe.step, static_argnames="compress")
        for i, compress in enumerate(schedule):
            loss, grads, states, _ = step(params, batch, states, jax.random.key(i), compress)
            arrays[f"{name}/{i}/loss"] = np.asarray(loss)
            for j, g in enumerate(jax.tree.leaves(grads.unpack())):
                arrays[f"{name}/{i}/grad/{j}"] = np.asarray(g)
            if replicas > 1:
                per = [jax.tree.map(lambda a, r=r: a[:, r], states) for r in range(replicas)]
            else:
                per = [states]
            for r, st in enumerate(per):
                for j, a in enumerate(old_ends(st)):
                    arrays[f"{name}/{i}/ends/{r}/{j}"] = a
    np.savez_compressed(GOLDEN, **arrays)
    print(f"wrote {len(arrays)} arrays to {GOLDEN}")


def _with_old_pipeline(commit, package=None):
    """Re-runs this script on a copy of the package (the working tree's, or ``package``'s, a
    commit) whose ``pipeline`` is that of ``commit``."""
    import os
    import shutil
    import subprocess
    import tempfile

    root = HERE.parents[1]
    tmp = pathlib.Path(tempfile.mkdtemp())

    def extract(rev, path):
        archive = subprocess.run(
            ["git", "-C", str(root), "archive", rev, path], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)

    if package is None:
        shutil.copytree(root / "jaxcomp", tmp / "jaxcomp")
    else:
        extract(package, "jaxcomp")
    shutil.rmtree(tmp / "jaxcomp" / "pipeline")
    extract(commit, "jaxcomp/pipeline")
    env = {**os.environ, "PYTHONPATH": str(tmp)}
    subprocess.run([sys.executable, __file__, "record"], env=env, check=True)


if __name__ == "__main__" and sys.argv[1:2] == ["record"]:
    import os

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    if sys.argv[2:3] == ["--old-pipeline"]:
        _with_old_pipeline(sys.argv[3], *(sys.argv[5:6] if sys.argv[4:5] == ["--package"] else []))
    else:
        record()
