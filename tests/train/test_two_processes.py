"""Every training mode as 2 ``jax.distributed`` processes x 2 CPU devices (gloo) == one process
with the same 4 devices, a stop and a resume included; and a resume on the other split
(issue 37, item 4).

One launch of two worker processes (``_two_process_worker.py``, set up as the trainer's CLI
sets up a process) trains every case of :data:`CASES` in turn: stopped after ``STOP`` steps
(checkpoint), then the same command again, which resumes and finishes. Meanwhile this process
trains each case's reference uninterrupted on ``jax.devices()[:4]`` (a resumed run continues
bit-identically: ``tests/train/test_trainer.py``). The dense case resumes across the split
instead: its 2-process run, stopped, is finished here (2 x 2 -> 1 x 4), and a run stopped here
is finished by the pair (1 x 4 -> 2 x 2), both equal to the uninterrupted reference (the mesh,
``('data', -1)``, comes out the same); on 8 devices the mesh would not, and the resume is
refused before anything compiles, with one line naming both.

The mesh's first axis spans the processes (``comm.make_mesh`` orders devices process by
process), so every mode sends something across the process boundary: the gradient mean (dense,
the batch-size variant), the slow axis of a (slow, fast) pair (Accordion), a pipeline boundary
(stage 0 on one process, stage 1 on the other), AB-Training's syncs between its two groups.

Compared: every metrics record and the summary (integers equal, floats to ``RTOL``), and every
leaf of the final checkpoint (the 2-process one restored here). The tolerance: gloo's
all-reduce adds the devices' terms in another order than XLA:CPU's in-process all-reduce (a
float32 rounding per collective, grown by a few optimizer steps; measured: metrics within
1.1e-7 relative, checkpoint leaves within 0.7% of the tolerance, the pipeline's and Accordion's
on the pair bit-identical).
Both sides compile with XLA's optimisations off (``fast_compiles``: the comparison is to a
tolerance, not bits) and XLA:CPU's loop emitters (this process's from ``tests/conftest.py``, the
workers' from their ``XLA_FLAGS``); each worker resumes a case with the setup of the
run it stopped (``tests/shared_setups.py``).
"""

import json
import math
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxcomp import main as cli
from jaxcomp import train
from jaxcomp.train import _metrics

pytestmark = [pytest.mark.usefixtures("fast_compiles"), pytest.mark.slow]  # 2 subprocesses

WORKER = pathlib.Path(__file__).with_name("_two_process_worker.py")
ROOT = WORKER.parents[2]  # the repository: the workers import this checkout's jaxcomp
DEVICES = 2  # per process
STOP, STEPS = 2, 4
RTOL, ATOL = 1e-4, 1e-6

#: one hidden layer (``fc1 -> head``): the smallest MLP with a cut point (the pipeline's 2
#: stages), two compressed kernels (Accordion), one factorised (AB): every program is traced
#: and compiled three times over (here and in each worker), its cost grows with the layers
_SMALL = [f"total_steps={STEPS}", "log_every=1", "eval_every=2", "checkpoint_every=0",
          "batch_size=32", "eval_batch_size=40", "model.hidden=(16,)"]  # fmt: skip
_DP = [*_SMALL, "mesh=[('data',4)]"]
#: the dense case's resume on the other split: its free axis is 4 on 2 x 2 and on 1 x 4 devices
_FREE = [*_SMALL, "mesh=[('data',-1)]"]
#: name -> (--config, --set): each a mode, and what crosses the process boundary
CASES = {
    # the float gradient all-reduce (stopped by the pair, resumed here, and the other way)
    "dense": ("configs/digits_dense.py:smoke", _FREE),
    # Accordion (PowerSGD rank 2 / 1 by the detector, EF) on a (slow, fast) pair, slow = the
    # processes: dense over fast (in a process), compressed over slow, EF state per slow worker
    "accordion_pair": (
        "configs/digits_accordion.py:smoke",
        [*_SMALL, "mesh=[('slow',2),('fast',2)]"],
    ),
    # micro-batches accumulated, then compressed_mean(quantize 4-bit + EF: an all-gather)
    "accordion_batch_size": (
        "configs/digits_accordion.py:smoke",
        [
            *_DP,
            "data_parallel.transform=accordion_batch_size",
            "data_parallel.large_steps=2",
            "data_parallel.codec={'name':'quantize','bits':4,'feedback':'ef'}",
        ],
    ),
    # 1F1B, stage 0 (fc1) on one process and stage 1 (head) on the other (the boundary
    # crosses), 2 replicas averaged by PowerSGD + EF; adaptive links (their modes read on the
    # host every step): per-sample TopK + EF forward with per-sample buffers (so the loader
    # keeps each sample on its replica: data.Loader(shards=2), each process's replicas fed
    # their own shards), stochastic quantisation backward (keys agree)
    "pipeline": (
        "configs/digits_pipeline_1f1b_powersgd.py:smoke",
        [
            *_SMALL,
            "mesh=[('stage',2),('data',2)]",
            "model.cuts=('fc1',)",
            "pipeline.num_microbatches=2",
            "pipeline.forward={'name':'top_k','fraction':0.25,'per_sample':True,'feedback':'ef',"
            "'per_sample_buffers':True}",
            "pipeline.backward={'name':'quantize','bits':8,'rounding':'stochastic'}",
            "pipeline.forward_high={'name':'top_k','fraction':0.1,'per_sample':True,'feedback':'ef',"
            "'per_sample_buffers':True}",
            "pipeline.backward_high={'name':'quantize','bits':4,'rounding':'stochastic'}",
            "pipeline.detector={'interval_epochs':1,'check_every':1,'eta':0.5}",
        ],
    ),
    # 2 groups of 2 (a group per process): warm-up, re-factorisation, AB steps, a sync
    "ab": (
        "configs/digits_ab.py:smoke",
        [
            *_SMALL,
            "mesh=[('group',2),('member',2)]",
            "ab.exclude=('fc1',)",
            "ab.max_rank_fraction=0.5",
        ],
    ),
}


def _config(name):
    spec, sets = CASES[name]
    return train.apply_overrides(cli.load_config(str(ROOT / spec)), train.parse_overrides(sets))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: the case that resumes across the split (stopped by the pair first, finished by it last)
ACROSS = "dense"


class _Pair:
    """Both worker processes, started on every case of :data:`CASES` (run in the background:
    this process trains the references meanwhile); last, they finish ``resume_here``, this
    process's stopped run of :data:`ACROSS`, once the file ``ready`` exists."""

    def __init__(self, out: pathlib.Path, resume_here: pathlib.Path, ready: pathlib.Path):
        self.out = out
        out.mkdir()
        cases = out / "cases.json"
        todo = [{"name": n, "config": str(ROOT / spec), "set": sets, "stop_after": STOP,
                 "resume": n != ACROSS} for n, (spec, sets) in CASES.items()]  # fmt: skip
        todo.sort(key=lambda c: c["name"] != ACROSS)  # this process resumes it after the pair
        spec, sets = CASES[ACROSS]
        todo.append({"name": f"{ACROSS}_from_one", "config": str(ROOT / spec), "set": sets,
                     "workdir": str(resume_here), "wait_for": str(ready)})  # fmt: skip
        cases.write_text(json.dumps(todo))
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
        env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
                   JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1")  # fmt: skip
        env["XLA_FLAGS"] = "--xla_cpu_use_fusion_emitters=false"  # conftest: fast_compiles
        argv = [str(_free_port()), str(DEVICES), str(cases), str(out)]
        self.logs = [open(out / f"process{i}.log", "w+") for i in range(2)]
        self.procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), str(i), *argv],
                env=env,
                stdout=self.logs[i],
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            for i in range(2)
        ]

    def wait(self) -> None:
        """Raises with the end of each process's log if one failed (or ran past 10 minutes)."""
        codes = []
        try:
            for p in self.procs:
                try:
                    codes.append(p.wait(timeout=600))
                except subprocess.TimeoutExpired:
                    codes.append("timeout")
        finally:
            self.kill()
        if codes != [0, 0]:
            tails = []
            for i, log in enumerate(self.logs):
                log.seek(0)
                tails.append(f"--- process {i} (exit {codes[i]})\n{log.read()[-4000:]}")
            raise AssertionError("\n".join(tails))

    def kill(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def _close(got, want, what):
    if isinstance(want, str) or isinstance(want, bool) or want is None:
        assert got == want, what
    elif isinstance(want, int) and isinstance(got, int):
        assert got == want, what
    elif isinstance(want, list | dict):
        assert type(got) is type(want) and len(got) == len(want), what
        items = want.items() if isinstance(want, dict) else enumerate(want)
        for k, v in items:
            _close(got[k], v, f"{what}[{k!r}]")
    else:
        assert math.isclose(got, want, rel_tol=RTOL, abs_tol=ATOL), (what, got, want)


def _restored(workdir: str, like):
    """The newest checkpoint of a 2-process run, restored in this process onto one device
    (orbax needs a target for another topology), in ``like``'s raw structure."""
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), like)
    ckpt = train.Checkpointer(workdir)
    try:
        step = ckpt.all_steps()[-1]
        assert step == STEPS
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target))
        return ckpt.manager.restore(step, args=args)["state"]
    finally:
        ckpt.close()


def _compare(name: str, got_dir: str, want_dir: str, last_checkpoint) -> None:
    got, want = train.read_metrics(got_dir), train.read_metrics(want_dir)
    # every record (train per step, eval at step 2 and the final one): the same keys, steps
    assert [(r["step"], r["split"], sorted(r)) for r in got] == [
        (r["step"], r["split"], sorted(r)) for r in want
    ]
    assert [r["step"] for r in got if r["split"] == "train"] == list(range(1, STEPS + 1))
    _close(got, want, "metrics")
    summary = [json.loads(pathlib.Path(d, "summary.json").read_text()) for d in (got_dir, want_dir)]
    for s in summary:
        s.pop("wall_time_s")
    _close(summary[0], summary[1], "summary")
    want_step, want_state = last_checkpoint(want_dir)
    assert want_step == STEPS
    got_leaves = jax.tree.leaves(_restored(got_dir, want_state))
    want_leaves = jax.tree.leaves(want_state)
    assert len(got_leaves) == len(want_leaves)
    for i, (a, b) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, i
        if np.issubdtype(b.dtype, np.inexact):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=f"leaf {i}")
        else:
            np.testing.assert_array_equal(a, b, err_msg=f"leaf {i}")


@pytest.mark.usefixtures("shared_setups")  # the dense case: 3 runs of one config here
def test_every_mode_as_two_processes_matches_one_process(
    tmp_path, last_checkpoint, capsys, monkeypatch
):
    """One test (one launch, on one pytest-xdist worker): the pair trains every case while
    this process trains the references; then each case is compared, failures collected."""
    # no curves here either (the worker's comment)
    monkeypatch.setattr(_metrics, "plot_metrics", lambda workdir, path=None: None)
    four = jax.devices()[:4]
    from_one, ready = tmp_path / "from_one", tmp_path / "from_one.ready"
    pair = _Pair(tmp_path / "two", from_one, ready)
    try:
        dense = _config(ACROSS)
        stopped = train.train_and_evaluate(dense, str(from_one), devices=four, stop_after=STOP)
        assert stopped == {"stopped_at": STOP}
        shutil.copytree(from_one, tmp_path / "eight")
        ready.touch()
        for name in CASES:
            train.train_and_evaluate(_config(name), str(tmp_path / "one" / name), devices=four)
    except BaseException:
        pair.kill()
        raise
    pair.wait()
    capsys.readouterr()
    # 2 x 2 -> 1 x 4 (here); 1 x 4 -> 2 x 2 was the pair's last run
    train.train_and_evaluate(dense, str(pair.out / ACROSS), devices=four)
    out = capsys.readouterr().out
    pair.logs[0].seek(0)
    pair_out = pair.logs[0].read()
    # (the side that ran on 4 of this process's 8 devices records 8: its count is left out)
    for text, saved, now in ((out, "2 process(es) x 2 cpu", "1 process(es) x"),
                             (pair_out, "1 process(es) x", "2 process(es) x 2 cpu")):  # fmt: skip
        assert f"resumed from step {STOP}" in text, text[-3000:]
        assert f"the checkpoint was saved by {saved}" in text, text[-3000:]
        assert f"this run has {now}" in text, text[-3000:]
    failed = {}
    runs = {name: pair.out / name for name in CASES} | {f"{ACROSS}_from_one": from_one}
    for name, got in runs.items():
        want = tmp_path / "one" / name.removesuffix("_from_one")
        try:
            _compare(name, str(got), str(want), last_checkpoint)
        except AssertionError as e:
            failed[name] = str(e)[:2000]
    for log in pair.logs:
        log.close()
    assert not failed, "\n".join(f"{name}: {e}" for name, e in failed.items())
    # 1 x 8: config.mesh's -1 would make 8 workers of 4: refused before compiling
    refused = (
        r"computed on mesh \{'data': 4\} .* give config.mesh \[\('data', -1\)\] the sizes "
        r"\{'data': 8\}: another mesh changes what each step computes. Resume on 4 devices"
    )
    with pytest.raises(train.SetupError, match=refused):
        train.train_and_evaluate(dense, str(tmp_path / "eight"))
    assert "compiling" not in capsys.readouterr().out
    assert train.Checkpointer(str(tmp_path / "eight")).all_steps()[-1] == STOP  # untouched
    # the pipeline case keeps per-sample buffers on 2 replicas: both runs fed each replica its
    # own shard of the split (data.Loader(shards=2)) and counted the sends that met a cold buffer
    for run in (pair.out / "pipeline", tmp_path / "one" / "pipeline"):
        meta = json.loads((run / "checkpoints" / str(STEPS) / "meta" / "metadata").read_text())
        assert meta["data_split"]["shards"] == 2, meta["data_split"]
        assert all("cold_sends" in r for r in train.read_metrics(str(run)) if r["split"] == "train")
