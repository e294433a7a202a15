"""Issue 37's "a peer killed just before a save" retried: a 2-process digits_dense run (the
settings of tests/test_multihost_faults.py) whose process 1 is killed (-9) at step 59 and, on
the resumed run, at step 79 (saves every 20 steps); prints process 0's exit code, time and
line, what is on disk, then reruns to step 120.

    env PYTHONPATH=. python docs/results/faults/peer_killed.py /tmp/peer_killed
"""

import os
import pathlib
import shutil
import signal
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parents[3] / "tests"))
import test_multihost_faults as t  # noqa: E402 - its Run: the CLI on 2 processes


def main(base: pathlib.Path) -> None:
    shutil.rmtree(base, ignore_errors=True)
    work, logs = base / "run", base / "logs"
    logs.mkdir(parents=True)
    for kill_at in (59, 79):
        run = t.Run(work, logs)
        try:
            run.wait_step(kill_at, timeout=240)
            os.kill(run.procs[1].pid, signal.SIGKILL)
            killed = time.monotonic()
            (t0,) = run.wait_exit([0])
        finally:
            run.kill()
        out = run.out(0)
        print(f"process 1 killed at step {run.step()}: process 0 exit {run.code(0)} "
              f"{t0 - killed:.2f} s later, {out.count('Traceback')} tracebacks")  # fmt: skip
        print("  ", *[x for x in out.splitlines() if x.startswith("error")])
        print("   checkpoints:", sorted(os.listdir(work / "checkpoints")),
              "checkpoints.damaged:", (work / "checkpoints.damaged").exists())  # fmt: skip
    run = t.Run(work, logs, total_steps=120)
    run.wait_exit(timeout=240)
    print("rerun: exit", [run.code(i) for i in (0, 1)],
          *[x.strip() for x in run.out(0).splitlines() if "resumed" in x])  # fmt: skip


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
