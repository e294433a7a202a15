"""Two processes x 2 CPU devices (gloo collectives) == one process with 4 devices."""

import importlib.util
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np

from jaxcomp import pipeline

WORKER = pathlib.Path(__file__).with_name("_two_process_worker.py")


def _worker_module():
    spec = importlib.util.spec_from_file_location("_two_process_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_process(tmp_path):
    port, out = _free_port(), tmp_path / "two_process.npz"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    root = WORKER.parents[2]  # the repository, so the workers import this checkout's jaxcomp
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(port), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        finally:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)

    reference = _worker_module().run(pipeline.pipeline_mesh(4, jax.devices()[:4]))
    got = dict(np.load(out))
    assert sorted(got) == sorted(reference)
    for name, value in reference.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
