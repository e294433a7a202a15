"""Alternates old/new trees: time to step 1 and process wall for given configs."""
import os, subprocess, sys, time, tempfile, statistics
trees = {"old": os.environ.get("OLD_TREE", "/tmp/lead_mainchk"), "new": sys.argv[1]}
configs = sys.argv[2].split(",")
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
res = {}
for r in range(rounds):
    for cfg in configs:
        for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
            with tempfile.TemporaryDirectory() as wd:
                cmd = ["/work/main/.venv/bin/python", "-m", "jaxcomp.main", "--config", f"configs/{cfg}.py", "--workdir", wd,
                       "--set", "total_steps=100", "--set", "eval_every=50", "--set", "checkpoint_every=50", "--set", "log_every=1"]
                t0 = time.perf_counter()
                p = subprocess.Popen(cmd, cwd=trees[side], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": trees[side]})
                first = None
                for line in p.stdout:
                    if line.startswith("step ") and first is None:
                        first = time.perf_counter() - t0
                assert p.wait() == 0, (cfg, side)
                wall = time.perf_counter() - t0
                res.setdefault((cfg, side), []).append((first, wall))
                print(cfg, side, f"step1 {first:.2f} s, wall {wall:.2f} s", flush=True)
for (cfg, side), v in sorted(res.items()):
    f = [a for a, _ in v]; w = [b for _, b in v]
    print(f"{cfg:28s} {side}: step1 median {statistics.median(f):.2f} [{min(f):.2f}-{max(f):.2f}] wall {statistics.median(w):.2f} [{min(w):.2f}-{max(w):.2f}]")
