"""Nothing compiles once training has started (issue 13: "no stall over 2 s at any step").

The first evaluation and checkpoint used to compile the evaluation step, the checkpoint
digest and orbax's per-leaf replica ``slice`` programs in the middle of the run: a 1.3-2.2 s
gap between two steps on 2 cores. Everything a run needs is now compiled before step 1; these
tests count JAX's trace, lowering and compile events after the first step returns (counted
whether or not the persistent compilation cache of the test run serves the executable).
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import train
from jaxcomp.main import load_config
from jaxcomp.train import _trainer

REPO = pathlib.Path(__file__).parents[2]
EVENTS = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")


def _run_counting_compiles(config, workdir, monkeypatch, **kwargs):
    """Runs ``config``; returns ``(summary, [(event, function, train steps done) ...])``, with
    -1 steps for the events of the setup (the mode's build)."""
    steps, events = [-1], []
    real = _trainer.setup

    def counting_setup(config, devices=None):
        s = real(config, devices=devices)
        steps[0] = 0
        step_fn = s.mode.train_step

        def train_step(*args):
            out = step_fn(*args)
            steps[0] += 1
            return out

        return s._replace(mode=s.mode._replace(train_step=train_step))

    def listener(event, duration, fun_name=None, **_):
        del duration
        if event.rsplit("/", 1)[-1] in EVENTS:
            events.append((event.rsplit("/", 1)[-1], fun_name, steps[0]))

    with monkeypatch.context() as patch:  # undone on return: a second run counts afresh
        patch.setattr(_trainer, "setup", counting_setup)
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            summary = train.train_and_evaluate(config, str(workdir), **kwargs)
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
    return summary, events


def _tiny(make_config, mode):
    extra = {
        "dense": {},
        "data_parallel": {
            "data_parallel": {
                "transform": "compressed_mean",
                "codec": {"name": "quantize", "bits": 8},
            }
        },
        "pipeline": {  # evaluates with compression on and off; link states to carry (EF)
            "mesh": [("stage", 2)],
            "model": {"hidden": (16,)},
            "batch_size": 32,
            "eval_batch_size": 32,
            "pipeline": {
                "num_microbatches": 2,
                "forward": {"name": "quantize", "bits": 8, "feedback": "ef"},
            },
        },
    }[mode]
    # checkpoints at 2, 4, 6, 8 with keep 2: the third save reads one back before pruning
    return make_config(
        mode=mode, total_steps=8, log_every=1, eval_every=3, checkpoint_every=2, **extra
    )


def test_dense_setup_compiles_only_the_training_step_init_and_evaluation(make_config):
    """Building the dense mode lowers the training step, the state init and the evaluation
    step (compiled side by side) and nothing else: the abstract state comes from an abstract
    key (an eager ``jax.random.key(0)`` under the mesh compiled two programs that the run
    compiled again outside it)."""
    lowered = []

    def listener(event, duration, fun_name=None, **_):
        del duration
        if event.endswith("jaxpr_to_mlir_module_duration"):
            lowered.append(fun_name)

    jax.clear_caches()  # programs another test compiled would not be lowered again
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        _trainer.setup(make_config())
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    # the init's key part (jaxcomp._cpu._init_program) is lowered as B's compile ends, in a
    # compile thread: its place among the others is a race (seen once in a full suite)
    expected = ["jit(train_step)", "jit(init)", "jit(eval_step)", "jit(init_key_part)"]
    assert sorted(lowered) == sorted(expected), lowered


def test_a_state_saved_from_host_copies_restores_every_dtype_and_sharding(tmp_path):
    """Orbax is handed host copies of the state: restoring with the abstract target gives back
    ``jax.Array`` s of the same values, dtypes and shardings (replicated, sharded, 0-d)."""
    mesh = jax.make_mesh((8,), ("data",))
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(0)
    host = {
        "f32": rng.standard_normal((16, 3)).astype(np.float32),
        "bf16": rng.standard_normal((8,)).astype(jnp.bfloat16),
        "f16": rng.standard_normal((8, 2)).astype(np.float16),
        "i8": rng.integers(-128, 128, (16,)).astype(np.int8),
        "u32": rng.integers(0, 2**32, (2,), dtype=np.uint32),
        "bool": rng.random((8,)) < 0.5,
        "step": np.array(7, np.int32),
    }
    where = {"f32": split, "i8": split, "bool": split}
    state = {k: jax.device_put(v, where.get(k, rep)) for k, v in host.items()}
    ckpt = train.Checkpointer(str(tmp_path))
    assert ckpt.save(3, state, {"step": 3})
    ckpt.close()
    ckpt = train.Checkpointer(str(tmp_path))
    step, back, meta = ckpt.restore_latest(state)
    ckpt.close()
    assert step == 3 and meta["step"] == 3
    for k, v in host.items():
        assert isinstance(back[k], jax.Array), k
        assert back[k].dtype == v.dtype and back[k].sharding == state[k].sharding, k
        np.testing.assert_array_equal(np.asarray(back[k]), v)


# the two tests above run with XLA's optimisations on (the dense setup lowers the split
# init only then); the runs below count compiles, not bits: unoptimised (``fast_compiles``
# stays on to the end of the module once a test asks for it, so they come last)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["data_parallel", "pipeline"])  # dense: the resumed run's
@pytest.mark.usefixtures("fast_compiles")
def test_evaluation_and_checkpoints_compile_nothing_after_the_first_step(
    make_config, mode, tmp_path, monkeypatch
):
    config = _tiny(make_config, mode)
    summary, events = _run_counting_compiles(config, tmp_path, monkeypatch)
    assert summary["steps"] == 8
    assert any(n == -1 for *_, n in events)  # the listener saw setup's compiles
    late = [e for e in events if e[2] >= 1]
    assert not late, late
    _assert_init_and_evaluation_compiled_at_setup(events, **SETUP_PROGRAMS[mode])


#: What each mode compiles in its build besides its step programs (``init``: the state's or the
#: model's init; ``also``: further programs), and the small programs its state init may still
#: compile when the trainer calls it (data parallel: its per-leaf copies and placements).
SETUP_PROGRAMS = {
    "dense": {},
    "data_parallel": {
        "also": ("jit(init_fn)", "jit(check)"),
        "at_init": {"jit(copy)", "jit(place)"},
    },
    "pipeline": {"init": "jit(full_init)"},
}


def _assert_init_and_evaluation_compiled_at_setup(
    events, init="jit(init)", also=(), at_init=frozenset()
):
    """The mode's state init and evaluation step compile beside its step programs, in its
    build (side by side: jaxcomp._compile); their calls later are served by JAX's caches.
    What compiles after the build is the trainer's own key handling (and data parallel's
    placement copies)."""
    compiled = [(f, n) for e, f, n in events if e == "backend_compile_duration"]
    for name in (init, "jit(eval_step)", *also):
        assert (name, -1) in compiled and (name, 0) not in compiled, compiled
    keys = {"jit(stage)", "jit(_threefry_seed)", "jit(_threefry_fold_in)",
            "jit(convert_element_type)", *at_init}  # fmt: skip
    assert {f for f, n in compiled if n == 0} <= keys, compiled


@pytest.mark.usefixtures("fast_compiles")
def test_a_resumed_run_compiles_nothing_after_its_first_step(make_config, tmp_path, monkeypatch):
    """Restoring verifies the checkpoint with the same compiled digest the saves use. The
    run it resumes is the dense mode's case of the test above: its evaluation (step 3) and
    checkpoints (2, 4) compile nothing after step 1, its setup compiles the init and the
    evaluation; the resumed run's third save (6) reads one back before pruning."""
    config = _tiny(make_config, "dense")
    summary, events = _run_counting_compiles(config, tmp_path, monkeypatch, stop_after=4)
    assert summary == {"stopped_at": 4}
    assert any(n == -1 for *_, n in events)  # the listener saw setup's compiles
    late = [e for e in events if e[2] >= 1]
    assert not late, late
    _assert_init_and_evaluation_compiled_at_setup(events, **SETUP_PROGRAMS["dense"])
    summary, events = _run_counting_compiles(config, tmp_path, monkeypatch)
    assert summary["steps"] == 8
    late = [e for e in events if e[2] >= 1]
    assert not late, late


@pytest.mark.slow  # a setup of AB's step programs; the fast tier: the dense resumed run above
@pytest.mark.usefixtures("fast_compiles")
def test_ab_mode_compiles_nothing_after_the_first_step(tmp_path, monkeypatch):
    """The smoke AB config (warm-up 1, S = 2, D = 1): every step kind runs by step 4; its step
    programs are compiled at setup, evaluation and checkpoints before step 1."""
    config = load_config(f"{REPO}/configs/digits_ab.py:smoke")
    # fc1 -> fc2 -> head, fc2 factorised (AB excludes the first and last layers)
    config = train.apply_overrides(
        config,
        {"total_steps": 6, "log_every": 1, "eval_every": 3, "checkpoint_every": 2,
         "model.hidden": (16, 16)},
    )  # fmt: skip
    summary, events = _run_counting_compiles(config, tmp_path, monkeypatch)
    assert summary["steps"] == 6
    late = [e for e in events if e[2] >= 1]
    assert not late, late
    # the factors' init (AB's optimizer state) compiles beside the step programs too
    _assert_init_and_evaluation_compiled_at_setup(events, also=("jit(init_state)",))
