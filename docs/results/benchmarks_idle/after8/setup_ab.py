"""Time to step 1 and process wall of trainer configs, two trees run alternately.

``python setup_ab.py NEW_TREE CONFIG[,CONFIG...] [ROUNDS]`` runs each config (100 steps,
``log_every=1``) in the tree ``OLD_TREE`` (env; session 12 used main c8145de) and in
``NEW_TREE``, old/new order flipped every round, and prints per run and the medians [min-max].
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time

PY = "/work/main/.venv/bin/python"
OVERRIDES = ["total_steps=100", "eval_every=50", "checkpoint_every=50", "log_every=1"]


def run(tree: str, config: str) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as wd:
        cmd = [PY, "-m", "jaxcomp.main", "--config", f"configs/{config}.py", "--workdir", wd]
        for s in OVERRIDES:
            cmd += ["--set", s]
        t0 = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": tree}
        proc = subprocess.Popen(
            cmd, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        first = None
        for line in proc.stdout:
            if line.startswith("step ") and first is None:
                first = time.perf_counter() - t0
        assert proc.wait() == 0, (config, tree)
        return first, time.perf_counter() - t0


def main() -> None:
    trees = {"old": os.environ.get("OLD_TREE", "/tmp/lead_mainchk"), "new": sys.argv[1]}
    configs = sys.argv[2].split(",")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    res: dict = {}
    for r in range(rounds):
        for config in configs:
            for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
                first, wall = run(trees[side], config)
                res.setdefault((config, side), []).append((first, wall))
                print(config, side, f"step1 {first:.2f} s, wall {wall:.2f} s", flush=True)
    for (config, side), v in sorted(res.items()):
        f, w = [a for a, _ in v], [b for _, b in v]
        print(
            f"{config:28s} {side}: step1 median {statistics.median(f):.2f} "
            f"[{min(f):.2f}-{max(f):.2f}] wall {statistics.median(w):.2f} "
            f"[{min(w):.2f}-{max(w):.2f}]"
        )


if __name__ == "__main__":
    main()
