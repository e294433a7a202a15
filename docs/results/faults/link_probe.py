"""The link probe's cost (docs/results/faults/README.md): 2 hosts x 1 CPU device in the lab, both
links at 100 Mbit/s (and host 1 sending at 10 Mbit/s), one ``LinkProbe.measure()`` (2 rounds of
2 sends, each after a barrier, and one gather) timed 7 times per payload; host 0 prints the
medians, the probe's own times and the compile.

    sudo env PYTHONPATH=. tools/cpu-all python docs/results/faults/link_probe.py
"""

import json
import os
import statistics
import sys
import tempfile
import time

CALLS = 7
PAYLOADS = (1 << 20, 1 << 18)


def host() -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        os.environ["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
        process_id=int(os.environ["JAX_PROCESS_ID"]),
    )
    from jaxcomp.train import _link_probe

    out = []
    for payload in PAYLOADS:
        t0 = time.perf_counter()
        probe = _link_probe.LinkProbe(_link_probe.hosts_of(), payload)
        build = time.perf_counter() - t0
        probe.measure()  # first call: warm
        walls, sends = [], []
        for _ in range(CALLS):
            t0 = time.perf_counter()
            times = probe.measure()
            walls.append(time.perf_counter() - t0)
            sends.append(times.tolist())
        out.append({"payload_bytes": payload, "build_s": round(build, 3),
                    "measure_ms": [round(w * 1e3, 1) for w in walls],
                    "median_measure_ms": round(statistics.median(walls) * 1e3, 1),
                    "median_send_ms": [round(statistics.median(s[k] for s in sends) * 1e3, 1)
                                       for k in range(2)]})  # fmt: skip
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    from jaxcomp import lab
    from jaxcomp.lab import _faults

    for slow in (None, "10mbit"):
        with lab.Lab(2, "100mbit", devices=1) as lb, tempfile.TemporaryDirectory() as logs:
            if slow:
                _faults.set_rate(lb.net, 1, slow, direction="out")
            res = lb.run([sys.executable, os.path.abspath(__file__), "host"], logs, timeout_s=300)
            text = open(res.logs[0]).read()
            assert res.ok, (res, text[-2000:], open(res.logs[1]).read()[-2000:])
            (line,) = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
            print(json.dumps({"host 1 sends at": slow or "100mbit",
                              "probes": json.loads(line[7:])}, indent=1))  # fmt: skip


if __name__ == "__main__":
    host() if sys.argv[1:] == ["host"] else main()
