"""A pytest plugin that writes where each test's time goes (one JSON line per test).

    JAXCOMP_SUITE_PROFILE=/tmp/prof.jsonl PYTHONPATH=$PWD:$PWD/tools \
        tools/cpu-slot python -m pytest -p suite_profile tests/train -q

Per test (setup, call and teardown together): wall and process CPU seconds; the CPU seconds
of the child processes it ended (subprocess tests: CLI runs, process pairs, notebook kernels);
JAX's trace, lowering and backend-compile seconds and the number of backend compiles (and the
name and seconds of each compile of 0.1 s or more); the persistent compilation cache's hits,
the seconds they saved (as JAX records them) and the seconds spent reading and writing it.
Summarise with ``python tools/suite_profile.py /tmp/prof.jsonl [file|dir|test|programs|workers]``
(``dir``: per test directory).

Under pytest-xdist (``-n 2``: the plugin loads in each worker) a row also names its worker and
the test's end (``time.time()``); ``workers`` shows each worker's busy seconds, its last test's
end and how long it stood idle while the other still ran (the balance of the two workers).
``python tools/suite_profile.py /tmp/prof.jsonl durations tests/durations.json`` writes each test
file's seconds, which ``tests/conftest.py`` hands out longest first.
"""

import collections
import json
import os
import resource
import sys
import time

_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
    "/jax/compilation_cache/compile_time_saved_sec": "saved_s",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read_s",
}
_COUNTS = {
    "/jax/core/compile/backend_compile_duration": "compiles",
    "/jax/compilation_cache/cache_hits": "cache_hits",
}

_current = collections.Counter()


_programs: list = []  # (fun_name, seconds) of this test's compiles of at least 0.1 s


def _duration(event, duration, fun_name=None, **_):
    if event in _EVENTS:
        _current[_EVENTS[event]] += duration
    if event in _COUNTS:
        _current[_COUNTS[event]] += 1
    if event == "/jax/core/compile/backend_compile_duration" and duration >= 0.1:
        _programs.append((fun_name, round(duration, 3)))


def _event(event, **_):
    if event in _COUNTS:
        _current[_COUNTS[event]] += 1


def pytest_configure(config):
    import jax
    from jax._src import compiler

    jax.monitoring.register_event_duration_secs_listener(_duration)
    jax.monitoring.register_event_listener(_event)
    write = compiler._cache_write

    def timed_write(*args, **kwargs):
        t = time.perf_counter()
        try:
            return write(*args, **kwargs)
        finally:
            _current["cache_write_s"] += time.perf_counter() - t

    compiler._cache_write = timed_write


def pytest_runtest_protocol(item, nextitem):
    _current.clear()
    _programs.clear()
    _current["_wall"] = time.perf_counter()
    _current["_cpu"] = time.process_time()
    _current["_children"] = _children_cpu()


def _children_cpu():
    """User and system CPU seconds of the ended child processes (and the descendants they
    waited for): a subprocess test's children are counted when the test reaps them."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def pytest_runtest_logfinish(nodeid, location):
    path = os.environ.get("JAXCOMP_SUITE_PROFILE")
    if not path or "_wall" not in _current:
        return
    row = {k: round(v, 4) for k, v in _current.items() if not k.startswith("_")}
    row["wall_s"] = round(time.perf_counter() - _current["_wall"], 4)
    row["cpu_s"] = round(time.process_time() - _current["_cpu"], 4)
    row["children_cpu_s"] = round(_children_cpu() - _current["_children"], 4)
    row["test"] = nodeid
    row["worker"] = os.environ.get("PYTEST_XDIST_WORKER", "main")
    row["end"] = round(time.time(), 3)
    row["programs"] = list(_programs)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _summary(path, by="file", top=40):
    rows = list({r["test"]: r for r in map(json.loads, open(path))}.values())  # last run wins
    total = collections.Counter()
    groups = collections.defaultdict(collections.Counter)
    for r in rows:
        key = r["test"].split("::")[0] if by != "test" else r["test"]
        key = key.rsplit("/", 1)[0] if by == "dir" else key
        for k, v in r.items():
            if k not in ("test", "programs", "worker", "end"):
                groups[key][k] += v
                total[k] += v
        groups[key]["tests"] += 1
    cols = ["wall_s", "cpu_s", "children_cpu_s", "compile_s", "lower_s", "trace_s", "compiles",
            "cache_hits", "saved_s", "cache_read_s", "cache_write_s", "tests"]  # fmt: skip
    print(" ".join(f"{c:>10}" for c in cols), "name")
    for key, g in sorted(groups.items(), key=lambda kv: -kv[1]["wall_s"])[:top]:
        print(" ".join(f"{g[c]:10.1f}" for c in cols), key)
    print(" ".join(f"{total[c]:10.1f}" for c in cols), "TOTAL", len(rows))


def _programs_summary(path, top=40):
    """Compiles of 0.1 s or more by program name: count, seconds, files that compile it."""
    rows = list({r["test"]: r for r in map(json.loads, open(path))}.values())
    count, seconds, files = collections.Counter(), collections.Counter(), {}
    for r in rows:
        for name, t in r.get("programs", []):
            count[name] += 1
            seconds[name] += t
            files.setdefault(name, set()).add(r["test"].split("::")[0])
    print(f"{'seconds':>8} {'count':>6} {'files':>5} program")
    for name, t in seconds.most_common(top):
        print(f"{t:8.1f} {count[name]:6d} {len(files[name]):5d} {name}")


def _workers_summary(path, top=5):
    """Per xdist worker: tests, busy (the sum of its tests' wall), its first test's start and
    last test's end from the run's first start, its idle tail (the last end of any worker minus
    its own), and its longest tests."""
    rows = [json.loads(line) for line in open(path)]
    rows = [r for r in rows if "end" in r]
    start = min(r["end"] - r["wall_s"] for r in rows)
    last = max(r["end"] for r in rows)
    by = collections.defaultdict(list)
    for r in rows:
        by[r["worker"]].append(r)
    print(f"{'worker':>8} {'tests':>6} {'busy_s':>8} {'first_s':>8} {'last_s':>8} {'idle_s':>7}")
    for w, rs in sorted(by.items()):
        first = min(r["end"] - r["wall_s"] for r in rs) - start
        end = max(r["end"] for r in rs)
        busy = sum(r["wall_s"] for r in rs)
        print(f"{w:>8} {len(rs):6d} {busy:8.1f} {first:8.1f} {end - start:8.1f} {last - end:7.1f}")
        for r in sorted(rs, key=lambda r: -r["wall_s"])[:top]:
            began = r["end"] - r["wall_s"] - start
            print(f"{'':>8} {r['wall_s']:6.1f} s from {began:6.1f} s  {r['test']}")
    print(f"run: {last - start:.1f} s from the first test's start to the last test's end")


def _durations(path, out):
    """Update ``out``, the ``{test file: seconds}`` that ``tests/conftest.py`` orders the suite's
    modules by, with the files of the profile ``path`` (the wall of their tests in the xdist
    workers; the runner's rows, worker ``main``, are left out: those tests are deselected in
    the workers). Files the profile did not run keep their seconds; a profile without xdist
    rows (not run with ``-n``) is refused."""
    rows = list({r["test"]: r for r in map(json.loads, open(path))}.values())
    seconds = collections.Counter()
    for r in rows:
        if r.get("worker", "main") != "main":
            seconds[r["test"].split("::")[0]] += r["wall_s"]
    if not seconds:
        sys.exit(f"{path} holds no xdist worker's rows: profile with pytest -n 2")
    kept = json.load(open(out)) if os.path.exists(out) else {}
    kept.update({k: round(v, 1) for k, v in seconds.items()})
    with open(out, "w") as f:
        json.dump(dict(sorted(kept.items())), f, indent=0)
        f.write("\n")


if __name__ == "__main__":
    if sys.argv[2:3] == ["durations"]:
        _durations(sys.argv[1], sys.argv[3])
    elif sys.argv[2:3] == ["programs"]:
        _programs_summary(sys.argv[1])
    elif sys.argv[2:3] == ["workers"]:
        _workers_summary(sys.argv[1])
    else:
        _summary(sys.argv[1], *(sys.argv[2:3] or ["file"]))
