"""The public API: one object per public name across the subpackages, and layered imports."""

import ast
import importlib
import pathlib
import re
import types

import pytest

import jaxcomp

PACKAGES = ("compressors", "feedback", "comm", "pipeline", "transforms", "parallel", "models",
            "data", "train", "study", "lab")  # fmt: skip
# imports only go down (CONTRIBUTING.md): a package may import the ones before it
# (ab: AB-Training, re-exported by transforms and parallel, so below both)
ORDER = {"compressors": 0, "feedback": 1, "comm": 2, "ab": 2.5, "pipeline": 3, "transforms": 3,
         "parallel": 4, "models": 5, "data": 5, "train": 6, "bench": 7, "study": 7,
         "lab": 8}  # fmt: skip
ROOT = pathlib.Path(jaxcomp.__file__).parent


def public_names(modules) -> list[tuple[str, str, object]]:
    """``(package, name, object)`` of every public name (``__all__``) of ``modules``, a sequence
    of ``(package, module)``; subpackages exported as names are left out."""
    return [
        (package, name, getattr(module, name))
        for package, module in modules
        for name in module.__all__
        if not isinstance(getattr(module, name), types.ModuleType)
    ]


def alike_pairs(names) -> dict[str, list[str]]:
    """Names alike (equal up to case and underscores: ``Link``/``link``, ``per_worker``/
    ``PerWorker``) in different packages that are different objects. One package may pair a
    type with its constructor (``pipeline.Link``/``pipeline.link``); the same object re-exported
    by another package (``transforms.LOW_COMPRESSION`` is ``pipeline.LOW_COMPRESSION``) is one
    thing."""
    groups = {}
    for package, name, obj in names:
        groups.setdefault(name.lower().replace("_", ""), []).append((package, name, obj))
    clashes = {}
    for key, group in groups.items():
        packages = {p for p, _, _ in group}
        if len(packages) > 1 and len({id(o) for _, _, o in group}) > 1:
            clashes[key] = sorted(f"{p}.{n}" for p, n, _ in group)
    return clashes


def test_no_two_public_names_alike_for_different_things():
    modules = [("jaxcomp", jaxcomp)]
    modules += [(name, importlib.import_module(f"jaxcomp.{name}")) for name in PACKAGES]
    names = public_names(modules)
    assert len(names) > 200, "found too few public names: the scan is broken"
    clashes = alike_pairs(names)
    assert not clashes, f"public names alike for different things: {clashes}"


def test_the_check_finds_the_pairs_it_is_for():
    link, Link = object(), type("Link", (), {})  # noqa: N806
    names = [("pipeline", "Link", Link), ("pipeline", "link", link), ("study", "link", object()),
             ("comm", "per_worker", len), ("parallel", "PerWorker", abs),
             ("pipeline", "LOW", 0), ("transforms", "LOW", 0)]  # fmt: skip
    assert alike_pairs(names) == {
        "link": ["pipeline.Link", "pipeline.link", "study.link"],
        "perworker": ["comm.per_worker", "parallel.PerWorker"],
    }
    assert alike_pairs(names[:2]) == {}  # a type and its constructor in one package


# what only XLA:CPU needs stays behind the private door (jaxcomp._cpu)
CPU_KNOB = re.compile(r"malloc|lapack|blas|thread|xla|cpu", re.IGNORECASE)


def cpu_knobs(names) -> list[str]:
    """Public names that are CPU tuning: defined in the CPU door, or named for a CPU knob."""
    return sorted(
        f"{package}.{name}"
        for package, name, obj in names
        if CPU_KNOB.search(name) or getattr(obj, "__module__", "").startswith("jaxcomp._cpu")
    )


def test_no_cpu_knob_is_public():
    modules = [("jaxcomp", jaxcomp)]
    modules += [(name, importlib.import_module(f"jaxcomp.{name}")) for name in PACKAGES]
    assert not cpu_knobs(public_names(modules))


def test_the_cpu_knob_check_finds_what_was_public_before_the_door():
    from jaxcomp import _cpu

    names = [("jaxcomp", "tune_host_malloc", _cpu.tune_host_malloc),
             ("jaxcomp", "HostMalloc", _cpu.HostMalloc),
             ("parallel", "single_thread_lapack", _cpu._lapack.single_thread_lapack),
             ("parallel", "ab_mesh", object())]  # fmt: skip
    assert cpu_knobs(names) == ["jaxcomp.HostMalloc", "jaxcomp.tune_host_malloc",
                                "parallel.single_thread_lapack"]  # fmt: skip


@pytest.mark.parametrize(
    "module, name", [("jaxcomp", "tune_host_malloc"), ("jaxcomp", "HostMalloc"),
                     ("jaxcomp.parallel", "single_thread_lapack")]
)  # fmt: skip
def test_the_cpu_knobs_that_were_public_are_deprecated_aliases(module, name):
    from jaxcomp import _cpu

    with pytest.warns(DeprecationWarning, match=f"{name} is deprecated"):
        got = getattr(importlib.import_module(module), name)
    want = (
        _cpu._lapack.single_thread_lapack if name == "single_thread_lapack" else getattr(_cpu, name)
    )
    assert got is want
    assert name not in importlib.import_module(module).__all__


def test_transforms_exports_only_transformations_and_their_types():
    from jaxcomp import transforms

    for harness in ("data_parallel", "ab_data_parallel", "ab_mesh", "TrainState", "per_worker"):
        assert harness not in transforms.__all__, harness


def _imported_packages(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxcomp"):
            parts = node.module.split(".")
            names = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
            found.update(n.lstrip("_") for n in names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("jaxcomp."):
                    found.add(a.name.split(".")[1])
    return found & set(ORDER)


def test_imports_only_go_down():
    upward = []
    for package, level in ORDER.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for other in _imported_packages(path) - {package}:
                if ORDER[other] >= level:
                    upward.append(f"{path.relative_to(ROOT)} imports {other}")
    assert not upward, upward


def test_pipeline_is_at_most_12_modules():
    # issue 34, one place per concept: config, packed parameters, links and their state, the
    # schedules and tick engine, the adaptive detector, the driver, the constructors
    modules = sorted(p.name for p in (ROOT / "pipeline").rglob("*.py"))
    assert len(modules) <= 12, modules
