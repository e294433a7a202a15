"""Shared benchmark plumbing: fake devices, the timing harness, tables, JSON output.

Every benchmark times its candidates with :func:`round_robin`: a shared baseline (a copy for
codecs, the identity step for the pipeline, the dense step for data-parallel and AB-Training)
runs before *each* candidate call, in rounds whose candidate order is shuffled (a fixed seed),
so that load that comes and goes on a shared machine hits the baseline and the candidates
alike. Records carry the median and the interquartile range of every time, and the ratio to
the baseline with the quartiles of the paired ratios (each candidate sample over the baseline
sample just before it); :func:`load_average` is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

from jaxcomp._cpu import HostMalloc


def request_cpu_devices(n: int = 8) -> None:
    """Asks for ``n`` fake CPU devices; must run before JAX initialises its backend."""
    import jax

    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" or not os.environ.get("JAX_PLATFORMS"):
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:  # backend already initialised: keep what we have
            pass


def parser(doc: str, module: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes.

    Args:
      doc: the benchmark module's docstring: its first paragraph is the description (whole
        sentences; ``python -m pydoc MODULE`` shows the rest).
      module: the module's ``__name__``; names the command (``python -m jaxcomp.bench
        NAME``), whatever ``sys.argv[0]`` is.
    """
    first = " ".join(doc.strip().split("\n\n")[0].split())
    name = module.rsplit(".", 1)[-1]
    p = argparse.ArgumentParser(
        prog=f"python -m jaxcomp.bench {name}",
        description=first,
        epilog=f"More: python -m pydoc {module}",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--json", metavar="PATH", help="write results as JSON to PATH")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions (median reported)")
    return p


def time_interleaved(
    calls: Sequence[tuple[Callable[..., Any], tuple]], repeats: int = 20, warmup: int = 2
) -> list[float]:
    """Median wall times of several ``(fn, args)`` calls measured round-robin.

    Interleaving makes the ratios between them robust to load that comes and goes on a shared
    machine, which a back-to-back measurement is not. Prefer :func:`round_robin`, which also
    gives the spread and pairs every sample with a baseline sample.
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


class Timed(NamedTuple):
    """One candidate's samples from :func:`round_robin` and the baseline samples paired with it.

    Attributes:
      samples: wall times of the candidate (seconds), one per round.
      baseline: the baseline's wall time measured just before each of those samples.
      parts: per call of the candidate, its wall times (``samples`` is their sum).
    """

    samples: list[float]
    baseline: list[float]
    parts: list[list[float]]

    def stats(self, prefix: str = "time") -> dict[str, float]:
        """``{prefix}_s``, ``{prefix}_q1_s``, ``{prefix}_q3_s`` and the paired ratio's quartiles.

        ``ratio_q1`` and ``ratio_q3`` are the quartiles of ``samples[i] / baseline[i]``; the
        ratio itself (median over the shared baseline's median) is the caller's.
        """
        import numpy as np

        t = spread(self.samples)
        r = spread(list(np.asarray(self.samples) / np.asarray(self.baseline)))
        return {
            f"{prefix}_s": t["median"],
            f"{prefix}_q1_s": t["q1"],
            f"{prefix}_q3_s": t["q3"],
            "ratio_q1": r["q1"],
            "ratio_q3": r["q3"],
        }


def round_robin(
    baseline: Sequence[tuple[Callable[..., Any], tuple]],
    candidates: Sequence[Sequence[tuple[Callable[..., Any], tuple]]],
    repeats: int = 20,
    warmup: int = 2,
    seed: int = 0,
) -> tuple[Timed, list[Timed]]:
    """Times ``candidates`` against a shared ``baseline``, alternating call by call.

    Each candidate (and the baseline) is a sequence of ``(fn, args)`` calls whose wall times
    are summed into one sample (e.g. a codec's jitted encode then decode). Every round runs the
    candidates once each, in an order shuffled with ``seed``, and the baseline right before
    each of them; every call is waited for (``jax.block_until_ready``).

    Args:
      baseline: the reference calls (a copy of the input, the dense step, ...).
      candidates: the calls of each candidate.
      repeats: rounds (samples per candidate).
      warmup: untimed calls of everything first (compilation, caches).
      seed: the seed of the per-round shuffles.

    Returns:
      ``(baseline, [Timed per candidate])``: the baseline's :class:`Timed` has ``repeats *
      len(candidates)`` samples (its ``baseline`` field repeats them).

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.ones(1000)
      >>> base, (t,) = round_robin([(lambda x: x * 2.0, (x,))], [[(jnp.sum, (x,))]], 3, 1)
      >>> len(base.samples), len(t.samples)
      (3, 3)
    """
    import jax
    import numpy as np

    def run(calls) -> list[float]:
        times = []
        for fn, args in calls:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        return times

    for calls in [baseline, *candidates]:
        for _ in range(warmup):
            run(calls)
    rng = np.random.default_rng(seed)
    base = Timed([], [], [[] for _ in baseline])
    timed = [Timed([], [], [[] for _ in calls]) for calls in candidates]
    for _ in range(repeats):
        for i in rng.permutation(len(candidates)):
            b_parts = run(baseline)
            b = sum(b_parts)
            parts = run(candidates[i])
            base.samples.append(b)
            base.baseline.append(b)
            for acc, t in zip(base.parts, b_parts):
                acc.append(t)
            timed[i].samples.append(sum(parts))
            timed[i].baseline.append(b)
            for acc, t in zip(timed[i].parts, parts):
                acc.append(t)
    return base, timed


def spread(samples: Sequence[float]) -> dict[str, float]:
    """``{"median", "q1", "q3"}`` of timing samples (seconds)."""
    import numpy as np

    q1, median, q3 = np.percentile(np.asarray(samples), [25, 50, 75])
    return {"median": float(median), "q1": float(q1), "q3": float(q3)}


def side_by_side(name: str, jax_samples: Sequence[float], torch_samples: Sequence[float]) -> dict:
    """A ``bench peers`` record: both sides' median and quartiles and ``jax_over_torch``."""
    sj, st = spread(jax_samples), spread(torch_samples)
    return dict(
        name=name,
        jax_time_s=sj["median"],
        jax_q1_s=sj["q1"],
        jax_q3_s=sj["q3"],
        torch_time_s=st["median"],
        torch_q1_s=st["q1"],
        torch_q3_s=st["q3"],
        jax_over_torch=sj["median"] / st["median"],
    )


def load_average() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages (``/proc/loadavg``; empty elsewhere)."""
    try:
        with open("/proc/loadavg") as f:
            return [float(v) for v in f.read().split()[:3]]
    except OSError:
        return []


def env_info(host_malloc: HostMalloc | None = None) -> dict[str, Any]:
    """Versions and devices, recorded with every result file.

    Args:
      host_malloc: what ``python -m jaxcomp.bench`` did with the host allocator
        (:func:`jaxcomp._cpu.tune_host_malloc`); ``None`` when a benchmark's ``main`` was called
        in-process, which leaves the allocator as the caller set it.
    """
    import jax

    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "device_kind": jax.devices()[0].device_kind,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "host_malloc": "not set (run through python -m jaxcomp.bench)"
        if host_malloc is None
        else host_malloc.reason,
    }


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> None:
    """Prints ``rows`` with ``columns = [(key, format spec), ...]`` (the header alone if there
    are no rows, e.g. ``pipeline --only`` matching no link)."""
    cells = [[format(r[k], f) if r.get(k) is not None else "-" for k, f in columns] for r in rows]
    widths = [max([len(k), *(len(c[i]) for c in cells)]) for i, (k, _) in enumerate(columns)]
    print("  ".join(k.rjust(w) for (k, _), w in zip(columns, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def write_json(
    path: str | None,
    benchmark: str,
    results: list[dict[str, Any]],
    host_malloc: HostMalloc | None = None,
    **extra,
) -> None:
    """Writes ``{"benchmark", "env", "results", **extra}`` to ``path`` (if given); ``env`` is
    :func:`env_info` with ``host_malloc``."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {"benchmark": benchmark, "env": env_info(host_malloc), "results": results, **extra},
            f,
            indent=2,
        )
    print(f"wrote {path}")
