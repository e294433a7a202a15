"""The timed half of ``python -m jaxcomp.bench ab_training``: step time per AB step kind vs a
dense data-parallel step (the digits MLP of ``configs/digits_ab.py``), and the trainer's
digits_ab / digits_dense wall times (``--trainer-runs``). What is timed and why the AB kinds
cost more than a dense step: ``docs/performance.md``.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from jaxcomp.bench import _common

_common.request_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcomp import comm  # noqa: E402
from jaxcomp import models  # noqa: E402
from jaxcomp import parallel  # noqa: E402
from jaxcomp import transforms  # noqa: E402
from jaxcomp.ab import _programs  # noqa: E402
from jaxcomp.ab._parallel import kind_bytes  # noqa: E402

KIND_PHASE = {"dense": "full", "dense_then_refactor": "refactor", "ab": "ab",
              "ab_then_sync": "sync", "ab (lax.switch)": "ab_switch",
              "dense (finite check)": "full_checked",
              "ab (dense forward)": "ab_dense_forward"}  # fmt: skip


def _digits(rows: int = 128):
    """The digits MLP, its loss and a batch of ``rows`` rows."""
    model = models.get_model("mlp", hidden=(256, 256, 256))
    params = tuple(v["params"] for v in model.init(jax.random.key(0)))

    def loss_fn(params, batch):
        logits, _ = model.apply(tuple({"params": p} for p in params), batch["x"], train=True)
        return model.loss_fn(logits, batch["label"])

    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((rows, *model.input_shape)).astype(np.float32),
             "label": rng.integers(0, 10, rows).astype(np.int32)}  # fmt: skip
    return loss_fn, params, batch


def _dense_dp(loss_fn, params, batch, mesh):
    """The baseline: local gradients, ``pmean`` over all workers, Adam; replicated params."""
    axes = tuple(mesh.axis_names)
    tx = optax.adam(1e-3)

    def body(params, opt, batch):
        _, grads = comm.local_value_and_grad(loss_fn, axes)(params, batch)
        updates, opt = tx.update(lax.pmean(grads, axes), opt, params)
        return optax.apply_updates(params, updates), opt

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(axes)),
                               out_specs=(P(), P())))  # fmt: skip
    rep = NamedSharding(mesh, P())
    args = (jax.device_put(params, rep), jax.device_put(tx.init(params), rep),
            jax.device_put(batch, NamedSharding(mesh, P(axes))))  # fmt: skip
    compiled = fn.lower(*args).compile()
    return (lambda: compiled(*args)), comm.collective_report(compiled.as_text()).total_bytes


def _switch_step(config, loss_fn, params, batch, mesh, count):
    """The optax transform's single ``lax.switch`` program, at a step of index ``count``."""
    tx = transforms.ab_transform(config)
    axes = config.axis_name

    def body(params, opt, batch):
        params, opt = jax.tree.map(lambda x: x[0], (params, opt))
        _, grads = comm.local_value_and_grad(loss_fn, axes)(params, batch)
        updates, opt = tx.update(grads, opt, params)
        return jax.tree.map(lambda x: x[None], (optax.apply_updates(params, updates), opt))

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
    p, o = parallel.stack_per_worker((params, tx.init(params)), mesh)
    o = o._replace(count=jax.device_put(np.full(mesh.size, count, np.int32), o.count.sharding))
    args = (p, o, jax.device_put(batch, NamedSharding(mesh, P(axes))))
    compiled = fn.lower(*args).compile()
    return lambda: compiled(*args)


def _quartiles(x) -> tuple[float, float, float]:
    q25, q50, q75 = np.percentile(np.asarray(x), [25, 50, 75])
    return float(q50), float(q25), float(q75)


def time_kinds(repeats: int, rows_per_worker: int = 16) -> list[dict]:
    """Step time per kind vs the dense data-parallel step, round-robin (see the docstring).

    Raises:
      ValueError: if ``rows_per_worker`` is not a positive int.
    """
    if (
        isinstance(rows_per_worker, bool)
        or not isinstance(rows_per_worker, int)
        or (rows_per_worker < 1)
    ):
        raise ValueError(f"rows_per_worker must be a positive int; got {rows_per_worker!r}.")
    mesh = parallel.ab_mesh(2, jax.devices()[:8])
    loss_fn, params, batch = _digits(rows_per_worker * mesh.size)
    config = transforms.ABConfig(
        1e-3, warmup_steps=60, sync_every=40, full_rank_steps=5, exclude=("fc1", "head"),
        max_rank_fraction=0.25,
    )  # fmt: skip
    dp = parallel.ab_data_parallel(loss_fn, config, mesh, donate=False)  # one-thread LAPACK
    # like the baseline, no finiteness check (one more row times the dense kind with it); the
    # AB kinds with the factorised forward, as the trainer runs them (one more row without)
    factored = dict(factored_forward=models.factored_dense)
    programs = _programs.Programs(config, loss_fn, mesh, donate=False, check_finite=False,
                                  **factored)  # fmt: skip
    guarded = _programs.Programs(config, loss_fn, mesh, donate=False, **factored)
    dense_forward = _programs.Programs(config, loss_fn, mesh, donate=False, check_finite=False)
    state = dp.init(params)
    sharded = dp.shard_batch(batch)
    start = programs.run("factorise", state)[0]  # AB steps start from exact factors
    run = programs.run
    calls = {
        "dense": lambda: run("dense", state, sharded),
        "dense_then_refactor": lambda: run("refactor", run("dense", state, sharded)[0]),
        "ab": lambda: run("ab", start, sharded),
        "ab_then_sync": lambda: run("ab_then_sync", start, sharded),
        "ab (dense forward)": lambda: dense_forward.run("ab", start, sharded),
        "ab (lax.switch)": _switch_step(config, loss_fn, params, batch, mesh, count=61),
        "dense (finite check)": lambda: guarded.run("dense", state, sharded),
    }
    dense_call, dp_bytes = _dense_dp(loss_fn, params, batch, mesh)
    texts = {n: c.as_text() for n, c in programs.compile_all(state, sharded).items()}
    sizes = config.group_sizes([mesh.shape[a] for a in config.axis_name])
    by_kind = kind_bytes(config, sizes, texts)
    names = ["dense_dp", *calls]
    fns = [dense_call, *calls.values()]
    for fn in fns:  # warm up (and compile)
        for _ in range(2):
            jax.block_until_ready(fn())
    times = {n: [] for n in names}
    load_before = os.getloadavg()[0]
    for _ in range(repeats):
        for n, fn in zip(names, fns):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[n].append(time.perf_counter() - t0)
    load_after = os.getloadavg()[0]
    dense = _quartiles(times["dense_dp"])
    rows = []
    for kind in calls:
        key = {"ab (lax.switch)": "ab", "dense (finite check)": "dense",
               "ab (dense forward)": "ab"}.get(kind, kind)  # fmt: skip
        t = _quartiles(times[kind])
        ratio = _quartiles(np.asarray(times[kind]) / np.asarray(times["dense_dp"]))
        b = by_kind[key]
        rows.append({
            "model": "mlp_digits", "sync_mode": config.sync_mode,
            "phase": KIND_PHASE[kind], "step_kind": kind,
            "hlo_bytes_per_step": b.get("mean", b.get("all")), "dp_hlo_bytes_per_step": dp_bytes,
            "step_time_s": t[0], "step_time_q25_s": t[1], "step_time_q75_s": t[2],
            "dense_step_time_s": dense[0], "dense_step_time_q25_s": dense[1],
            "dense_step_time_q75_s": dense[2], "time_ratio_to_dense": ratio[0],
            "time_ratio_q25": ratio[1], "time_ratio_q75": ratio[2], "repeats": repeats,
            "rows_per_worker": rows_per_worker, "load_before": load_before,
            "load_after": load_after,
        })  # fmt: skip
    return rows


def trainer_runs(runs: int, steps: int = 300) -> list[dict]:
    """Wall times of digits_dense and digits_ab through the trainer, alternating."""
    repo = pathlib.Path(__file__).resolve().parents[2]
    if not (repo / "configs" / "digits_ab.py").exists():
        raise ValueError(f"--trainer-runs needs the repository's configs/ (not found in {repo}).")
    sets = [f"total_steps={steps}", "eval_every=100", "checkpoint_every=100", "log_every=25"]
    walls: dict[str, list[float]] = {"digits_dense": [], "digits_ab": []}
    summaries = {}
    load_before = os.getloadavg()[0]
    for _ in range(runs):
        for name in walls:
            with tempfile.TemporaryDirectory() as workdir:
                cmd = [sys.executable, "-m", "jaxcomp.main", "--config",
                       f"configs/{name}.py", "--workdir", workdir]  # fmt: skip
                cmd += [x for s in sets for x in ("--set", s)]
                subprocess.run(cmd, cwd=repo, check=True, capture_output=True)
                with open(os.path.join(workdir, "summary.json")) as f:
                    summaries[name] = json.load(f)
            walls[name].append(summaries[name]["wall_time_s"])
            print(f"  {name}: {walls[name][-1]:.1f} s", flush=True)
    dense, ab = _quartiles(walls["digits_dense"]), _quartiles(walls["digits_ab"])
    ratio = _quartiles(np.asarray(walls["digits_ab"]) / np.asarray(walls["digits_dense"]))
    return [{
        "model": "mlp_digits", "sync_mode": summaries["digits_ab"].get("sync_mode"),
        "phase": "trainer_run", "steps": steps,
        "hlo_bytes_per_step": summaries["digits_ab"]["wire_bytes_per_step"],
        "dp_hlo_bytes_per_step": summaries["digits_dense"]["wire_bytes_per_step"],
        "step_time_s": ab[0] / steps, "dense_step_time_s": dense[0] / steps,
        "wall_time_s": ab[0], "wall_time_q25_s": ab[1], "wall_time_q75_s": ab[2],
        "dense_wall_time_s": dense[0], "dense_wall_time_q25_s": dense[1],
        "dense_wall_time_q75_s": dense[2], "time_ratio_to_dense": ratio[0],
        "time_ratio_q25": ratio[1], "time_ratio_q75": ratio[2], "repeats": runs,
        "load_before": load_before, "load_after": os.getloadavg()[0],
    }]  # fmt: skip
