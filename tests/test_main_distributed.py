"""Joining the processes of a cluster: explicit flags win, SLURM/Open MPI/GKE TPU environments
are detected, and a real 2-process SLURM-style launch forms one 2-process JAX system."""

import argparse
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from jaxcomp import main

ROOT = pathlib.Path(__file__).parents[1]
SLURM2 = {
    "SLURM_JOB_ID": "7",
    "SLURM_STEP_NODELIST": "node[001-002]",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
}


def _args(*argv):
    return main.parse_args(["--config", "c.py", "--workdir", "w", *argv])


@pytest.mark.parametrize(
    "environ, cluster",
    [
        ({}, None),
        (SLURM2, "slurm"),
        ({**SLURM2, "SLURM_NTASKS": "1"}, None),  # a one-task allocation runs alone
        ({k: v for k, v in SLURM2.items() if k != "SLURM_STEP_NODELIST"}, None),  # salloc shell
        ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://h:1", "OMPI_COMM_WORLD_SIZE": "4"}, "open_mpi"),
        ({"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"}, "tpu_pod"),
        ({"TPU_WORKER_HOSTNAMES": "t0"}, None),  # a single-host TPU VM
    ],
)
def test_cluster_detection(environ, cluster):
    assert main.detected_cluster(environ) == cluster
    plan = main.distributed_plan(_args(), environ)
    assert plan == (None if cluster is None else {})  # {}: JAX reads the rest from the cluster


def test_explicit_flags_win_and_modes():
    explicit = _args("--coordinator_address", "h:1", "--num_processes", "2", "--process_id", "1")
    want = {"coordinator_address": "h:1", "num_processes": 2, "process_id": 1}
    assert main.distributed_plan(explicit, SLURM2) == want
    assert main.distributed_plan(_args("--distributed", "off"), SLURM2) is None
    assert main.distributed_plan(_args("--num_processes", "1"), SLURM2) is None
    assert main.distributed_plan(_args("--distributed", "on"), {}) == {}
    partial = _args("--coordinator_address", "h:9")  # overrides the detected coordinator only
    assert main.distributed_plan(partial, SLURM2) == {"coordinator_address": "h:9"}


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--num_processes", "2", "--process_id", "0"], "need --coordinator_address"),
        (
            ["--num_processes", "2", "--coordinator_address", "h:1", "--process_id", "2"],
            r"\[0, 2\)",
        ),
        (["--num_processes", "0"], "must be >= 1"),
        (["--num_processes", "2", "--distributed", "off"], "contradicts"),
    ],
)
def test_bad_flags_are_usage_errors(argv, match):
    with pytest.raises(main.UsageError, match=match):
        main.distributed_plan(_args(*argv), {})


def _free_slurm_job_id():
    """A job id whose SLURM port (61440 + id % 4096, as JAX derives it) is free here."""
    for job in range(1000, 5096):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 61440 + job % 4096))
            except OSError:
                continue
            return job
    pytest.skip("no free port in JAX's SLURM port range")


PROBE = (
    "from jaxcomp import main; import jax; "
    "args = ['--config', 'c', '--workdir', 'w', '--cpu_devices', '2'];"
    "main.setup_devices(main.parse_args(args));"
    "print('joined', jax.process_count(), jax.process_index(), jax.device_count(), flush=True)"
)


def test_a_slurm_launch_joins_both_processes():
    job = _free_slurm_job_id()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ["PYTHONPATH"]]),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "",
            **SLURM2,
            "SLURM_JOB_ID": str(job),
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", PROBE],
                env=env,
                cwd=ROOT,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        )
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for rank, out in enumerate(outs):
        assert f"joined 2 {rank} 4" in out, out


def test_a_namespace_without_the_flag_keeps_explicit_only():
    """jaxcomp.study builds its own Namespace: no detection, explicit flags still work."""
    bare = argparse.Namespace(coordinator_address=None, num_processes=None, process_id=None)
    assert main.distributed_plan(bare, SLURM2) is None
    two = argparse.Namespace(coordinator_address="h:1", num_processes=2, process_id=0)
    assert main.distributed_plan(two, {}) == {
        "coordinator_address": "h:1",
        "num_processes": 2,
        "process_id": 0,
    }
