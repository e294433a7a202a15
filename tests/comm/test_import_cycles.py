"""No import cycle: no module of jaxcomp imports, directly or through others, a module that
imports it back at module level (a function-level import does not hide one). Read from the
sources (``ast``), nothing imported: milliseconds."""

import ast
import pathlib

import jaxcomp

ROOT = pathlib.Path(jaxcomp.__file__).parent


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """The statements that run on import: the module's, and those in its ``if``/``try`` blocks."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return out


def imports(tree: ast.Module, modules: set[str], module_level: bool) -> set[str]:
    """The jaxcomp modules ``tree`` imports (a name imported from a package that is one of its
    submodules counts as that submodule)."""
    nodes = _module_level(tree) if module_level else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found |= {sub} if sub in modules else {node.module} & modules
    return found


def graphs(sources: dict[str, str]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``(any_level, module_level)`` import graphs of ``{module name: source}``."""
    modules = set(sources)
    trees = {m: ast.parse(s) for m, s in sources.items()}
    return (
        {m: imports(t, modules, False) - {m} for m, t in trees.items()},
        {m: imports(t, modules, True) - {m} for m, t in trees.items()},
    )


def cycles(sources: dict[str, str]) -> list[str]:
    """Every ``A -> ... -> B => A``: A imports B (at any level, through any modules) and B
    imports A at module level."""
    any_level, module_level = graphs(sources)
    found = []
    for b, targets in sorted(module_level.items()):
        for a in sorted(targets):
            seen, todo = {a}, [a]
            while todo:
                for nxt in any_level[todo.pop()] - seen:
                    seen.add(nxt)
                    todo.append(nxt)
            if b in seen:
                found.append(f"{a} imports {b} (directly or through others), which imports it back")
    return found


def test_no_module_imports_one_that_imports_it_back():
    sources = {module_name(p): p.read_text() for p in ROOT.rglob("*.py")}
    assert len(sources) > 100, "found too few jaxcomp modules: the scan is broken"
    assert not cycles(sources), cycles(sources)


def test_the_check_finds_a_cycle_hidden_behind_a_function_level_import():
    lazy = "def f():\n    from jaxcomp import {}\n"
    sources = {
        "jaxcomp.a": "from jaxcomp import b\n",
        "jaxcomp.b": lazy.format("c"),  # as _low_rank's deferred import of _low_rank_reduce was
        "jaxcomp.c": lazy.format("a"),
        "jaxcomp.d": "import jaxcomp.a\n",  # imports into the cycle, is not part of it
    }
    assert cycles(sources) == [
        "jaxcomp.b imports jaxcomp.a (directly or through others), which imports it back"
    ]
    sources["jaxcomp.a"] = lazy.format("b")  # every import of the cycle deferred: allowed
    assert cycles(sources) == []
