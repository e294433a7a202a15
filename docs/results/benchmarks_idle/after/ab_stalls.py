"""digits_dense vs digits_ab through the trainer, idle or beside a CPU-busy process.

``python ab_stalls.py REPO [--idle] [--cache]`` (env ``STEPS``, ``RUNS``): runs both configs
alternately with ``log_every=1`` and time-stamps every ``step N/`` line the trainer prints, so
the largest gap between consecutive steps (a stall) is seen; ``--idle`` leaves out the busy
process (a Python spin loop). ``--cache`` gives every run ``--compile_cache`` with one folder
per config, filled by one untimed run of each first: the warm-cache figures. Prints each run's
wall times and its three largest gaps (seconds, step).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

repo = sys.argv[1] if len(sys.argv) > 1 else "/work/main"
busy = "--idle" not in sys.argv
cache = tempfile.mkdtemp() if "--cache" in sys.argv else None
py = "/work/main/.venv/bin/python"
hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
res = {"digits_dense": [], "digits_ab": []}
try:
    for i in range(int(os.environ.get("RUNS", 2)) + (cache is not None)):
        for name in res:
            with tempfile.TemporaryDirectory() as wd:
                cmd = [py, "-m", "jaxcomp.main", "--config", f"configs/{name}.py", "--workdir", wd]
                if cache:
                    cmd += ["--compile_cache", os.path.join(cache, name)]
                for s in [
                    f"total_steps={os.environ.get('STEPS', 300)}",
                    "eval_every=100",
                    "checkpoint_every=100",
                    "log_every=1",
                ]:
                    cmd += ["--set", s]
                t0 = time.perf_counter()
                proc = subprocess.Popen(
                    cmd,
                    cwd=repo,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env={**os.environ, "PYTHONPATH": repo},
                )
                stamps = []
                for line in proc.stdout:
                    if line.startswith("step "):
                        stamps.append(
                            (int(line.split()[1].split("/")[0]), time.perf_counter() - t0)
                        )
                assert proc.wait() == 0, name
                wall = time.perf_counter() - t0
                gaps = sorted((round(b[1] - a[1], 2), b[0]) for a, b in zip(stamps, stamps[1:]))
                summ = json.load(open(os.path.join(wd, "summary.json")))
                if cache and i == 0:
                    print(name, f"cache filled: process {wall:.1f} s (not counted)", flush=True)
                    continue
                res[name].append(
                    dict(
                        wall=wall, run_wall=summ["wall_time_s"], first=stamps[0], max_gaps=gaps[-3:]
                    )
                )
                print(
                    name,
                    f"process {wall:.1f} s, trainer {summ['wall_time_s']:.1f} s, "
                    f"step 1 at {stamps[0][1]:.1f} s, "
                    f"largest gaps after step 1 (s, step) {gaps[-3:]}",
                    flush=True,
                )
finally:
    if hog:
        hog.kill()
d = statistics.median(r["run_wall"] for r in res["digits_dense"])
a = statistics.median(r["run_wall"] for r in res["digits_ab"])
label = ("busy" if busy else "idle") + (" warm cache" if cache else "")
print(f"{label}: dense {d:.1f} s, ab {a:.1f} s, ratio {a / d:.2f}")
