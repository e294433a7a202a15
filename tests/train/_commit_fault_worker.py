"""One process of a 2-process CLI run whose save of step :data:`FAIL` cannot write its commit
marker on process 0 (no space left) while the run is already stopping because the metrics
could not be written at the next step (run by test_checkpoint_faults.py).

    python _commit_fault_worker.py PROCESS_ID PORT WORKDIR

The disk-full stage of tests/test_multihost_faults.py met this order once (a hang: both
processes waited in orbax's barriers on the way out); here it is made certain: process 0's
commit of step :data:`FAIL` waits until the run has left its loop (the Checkpointer's
``__exit__``), then fails. Exits with the CLI's code.
"""

import asyncio
import errno
import os
import sys
import threading

FAIL = 4  #: the step whose commit fails on process 0; the metrics write fails at FAIL + 1
SETS = {"mesh": [("data", 2)], "model.hidden": (16, 16, 16), "batch_size": 32,
        "eval_batch_size": 40, "total_steps": 20, "log_every": 1, "eval_every": 0,
        "checkpoint_every": 2, "keep_checkpoints": 2}  # fmt: skip


def _faults() -> None:
    from orbax.checkpoint._src.path import atomicity

    from jaxcomp.train import _checkpoint
    from jaxcomp.train import _metrics

    leaving = threading.Event()
    real_exit = _checkpoint.Checkpointer.__exit__

    def exit_(self, kind, error, tb):
        if kind is not None:
            leaving.set()
        return real_exit(self, kind, error, tb)

    real_finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self):
        if self._final_path.name == str(FAIL):
            await asyncio.to_thread(leaving.wait, 60.0)
            marker = str(self.get() / atomicity.COMMIT_SUCCESS_FILE)
            raise OSError(errno.ENOSPC, "No space left on device", marker)
        return await real_finalize(self)

    real_time = _metrics.MetricWriter.write_time

    def write_time(self, step, *args):
        if step == FAIL + 1:
            raise OSError(errno.ENOSPC, "No space left on device", self.timing)
        return real_time(self, step, *args)

    _checkpoint.Checkpointer.__exit__ = exit_
    atomicity.AtomicRenameTemporaryPath.finalize = finalize
    _metrics.MetricWriter.write_time = write_time


def main(process_id: int, port: int, workdir: str) -> None:
    from jaxcomp import main as cli

    if process_id == 0:  # once JAX's processes are set up (jaxcomp.train imported after)
        real_setup = cli.setup_devices

        def setup_devices(args):
            real_setup(args)
            _faults()

        cli.setup_devices = setup_devices
    config = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "digits_dense.py")
    argv = ["--config", f"{config}:smoke", "--workdir", workdir, "--cpu_devices", "1",
            "--num_processes", "2", "--process_id", str(process_id), "--peer_timeout", "8",
            "--coordinator_address", f"127.0.0.1:{port}",
            *sum((["--set", f"{k}={v!r}"] for k, v in SETS.items()), [])]  # fmt: skip
    code = cli.main(argv)  # with several processes a StorageError exits at once (74)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
