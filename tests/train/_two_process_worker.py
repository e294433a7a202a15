"""One process of the two-process trainer runs (run by test_two_processes.py).

    python _two_process_worker.py PROCESS_ID PORT DEVICES CASES.json OUTDIR

Joins the 2-process JAX system as the trainer's CLI does (``jaxcomp.main.setup_devices``:
``--cpu_devices DEVICES --num_processes 2 --process_id PROCESS_ID --coordinator_address
127.0.0.1:PORT``, gloo collectives), then trains every case of CASES.json (a list of
``{"name", "config", "set", "stop_after", "resume"}``, the CLI's ``--config`` and ``--set``) into
``OUTDIR/<name>``: first stopped after ``stop_after`` steps (a checkpoint saved), then, if
``resume``, the same command again, which resumes and finishes (``main.main``'s steps, twice in
one process: one launch per process for every case; the resumed run reuses the stopped run's
setup). A case with ``"workdir"`` and ``"wait_for"`` instead resumes that workdir (another
topology's run) once the file ``wait_for`` exists.
"""

import importlib.util
import json
import os
import pathlib
import sys
import time


def main(process_id: int, port: int, devices: int, cases: str, out: str) -> None:
    from jaxcomp import main as cli

    argv = ["--config", "unused", "--workdir", "unused", "--cpu_devices", str(devices),
            "--num_processes", "2", "--process_id", str(process_id),
            "--coordinator_address", f"127.0.0.1:{port}"]  # fmt: skip
    cli.setup_devices(cli.parse_args(argv))
    import jax

    assert jax.process_count() == 2 and jax.local_device_count() == devices
    from jaxcomp import train
    from jaxcomp.train import _metrics
    from jaxcomp.train import _trainer

    # the resumed run takes the stopped run's setup (tests/shared_setups.py): its programs
    # are compiled once per case in each process
    spec = importlib.util.spec_from_file_location(
        "shared_setups", pathlib.Path(__file__).parents[1] / "shared_setups.py"
    )
    shared = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shared)
    _trainer.setup = train.setup = shared.caching(_trainer.setup, {})
    # no curves (a finished run's plot: 0.2 s each, and matplotlib's import; compared here are
    # the metrics they are drawn from; the plot itself: tests/train/test_trainer.py)
    _metrics.plot_metrics = lambda workdir, path=None: None
    with open(cases) as f:
        todo = json.load(f)
    for case in todo:
        config = cli.load_config(case["config"])
        config = train.apply_overrides(config, train.parse_overrides(case["set"]))
        start = time.perf_counter()
        if "wait_for" in case:  # another run's checkpoint, written by the test's process
            while not os.path.exists(case["wait_for"]):
                assert time.perf_counter() - start < 600, f"no {case['wait_for']}"
                time.sleep(0.05)
            train.train_and_evaluate(config, case["workdir"])
            continue
        workdir = os.path.join(out, case["name"])
        stop = case["stop_after"]
        assert train.train_and_evaluate(config, workdir, stop_after=stop) == {"stopped_at": stop}
        first = time.perf_counter() - start
        if case["resume"]:
            train.train_and_evaluate(config, workdir)  # resumes from the checkpoint, finishes
        if process_id == 0:
            took = time.perf_counter() - start
            print(f"case {case['name']}: {took:.1f} s ({first:.1f} s to the stop)", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
