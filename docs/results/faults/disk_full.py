"""The full disk of docs/results/faults/README.md: a 2-process digits_dense run on a 4 MiB tmpfs
filled under a save; prints both exit codes, their times after the fill and their lines, then
resumes with the same command once the space is freed.

    sudo env PYTHONPATH=. python docs/results/faults/disk_full.py /tmp/disk_full
"""

import os
import pathlib
import shutil
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parents[3] / "tests"))
import test_multihost_faults as t  # noqa: E402 - its Run: the CLI on 2 processes


def main(base: pathlib.Path) -> None:
    disk, logs = base / "disk", base / "logs"
    disk.mkdir(parents=True, exist_ok=True)
    logs.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=True)
    work = disk / "run"
    run = None
    try:
        run = t.Run(work, logs)
        run.wait_step(45)
        newest = work / "checkpoints" / str(t._checkpoints(work)[-1])
        size = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())
        free = shutil.disk_usage(disk).free
        (disk / "filler").write_bytes(b"\0" * max(free - size // 2, 0))
        filled = time.monotonic()
        ends = run.wait_exit(timeout=150)
        print("exit codes", [run.code(i) for i in (0, 1)], "s after the fill",
              [round(e - filled, 2) for e in ends])  # fmt: skip
        for i in (0, 1):
            print(f"process {i}:", *[x for x in run.out(i).splitlines() if x.startswith("error")])
        print("checkpoints", sorted(os.listdir(work / "checkpoints")))
        kept = t._checkpoints(work)
        (disk / "filler").unlink()
        run = t.Run(work, logs, total_steps=kept[-1] + 5)
        start = time.monotonic()
        ends = run.wait_exit(timeout=180)
        print("resume: exit codes", [run.code(i) for i in (0, 1)], "after",
              [round(e - start, 1) for e in ends], "s;",
              *[x.strip() for x in run.out(0).splitlines() if "resumed" in x])  # fmt: skip
    finally:
        if run is not None:
            run.kill()
        subprocess.run(["umount", "-l", str(disk)], check=True)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
