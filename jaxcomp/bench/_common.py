"""Shared benchmark plumbing: fake devices, timing, tables, JSON output."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any


def request_cpu_devices(n: int = 8) -> None:
    """Asks for ``n`` fake CPU devices; must run before JAX initialises its backend."""
    import jax

    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" or not os.environ.get("JAX_PLATFORMS"):
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:  # backend already initialised: keep what we have
            pass


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", metavar="PATH", help="write results as JSON to PATH")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions (median reported)")
    return p


def time_interleaved(
    calls: Sequence[tuple[Callable[..., Any], tuple]], repeats: int = 20, warmup: int = 2
) -> list[float]:
    """Median wall times of several ``(fn, args)`` calls measured round-robin.

    Interleaving makes the ratios between them robust to load that comes and goes on a shared
    machine, which a back-to-back measurement is not.
    """
    import numpy as np

    return [float(np.median(t)) for t in time_samples(calls, repeats, warmup)]


def time_samples(
    calls: Sequence[tuple[Callable[..., Any], tuple]], repeats: int = 20, warmup: int = 2
) -> list[list[float]]:
    """Every wall time of :func:`time_interleaved`'s round-robin (one list per call)."""
    import jax

    for fn, args in calls:
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for i, (fn, args) in enumerate(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[i].append(time.perf_counter() - t0)
    return times


def spread(samples: Sequence[float]) -> dict[str, float]:
    """``{"median", "q1", "q3"}`` of timing samples (seconds)."""
    import numpy as np

    q1, median, q3 = np.percentile(np.asarray(samples), [25, 50, 75])
    return {"median": float(median), "q1": float(q1), "q3": float(q3)}


def load_average() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages (``/proc/loadavg``; empty elsewhere)."""
    try:
        with open("/proc/loadavg") as f:
            return [float(v) for v in f.read().split()[:3]]
    except OSError:
        return []


def env_info() -> dict[str, Any]:
    """Versions and devices, recorded with every result file."""
    import jax

    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "device_kind": jax.devices()[0].device_kind,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> None:
    """Prints ``rows`` with ``columns = [(key, format spec), ...]``."""
    cells = [[format(r[k], f) if r.get(k) is not None else "-" for k, f in columns] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, (k, _) in enumerate(columns)]
    print("  ".join(k.rjust(w) for (k, _), w in zip(columns, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def write_json(path: str | None, benchmark: str, results: list[dict[str, Any]], **extra) -> None:
    """Writes ``{"benchmark", "env", "results", **extra}`` to ``path`` (if given)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {"benchmark": benchmark, "env": env_info(), "results": results, **extra}, f, indent=2
        )
    print(f"wrote {path}")
