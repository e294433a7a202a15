r"""Builds the API reference: every public name of jaxcomp, from its docstring, and the notebooks.

  python docs/api/build.py [OUTDIR]        # default docs/api/_build; open OUTDIR/html/index.html

One page per subpackage lists every name of its ``__all__`` (and the top level's), documented
from the docstrings by Sphinx's autodoc and napoleon; the notebooks are rendered with their
committed outputs (myst-nb, not executed). Any Sphinx warning fails the build (``-W``). The
sources are generated into ``OUTDIR/src`` (nothing is written into the repository). Needs the
``docs`` extra (``pip install -e '.[docs]'``).
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import pkgutil
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
#: the public subpackages, in the layers' order (imports only go down)
PACKAGES = ("compressors", "feedback", "comm", "pipeline", "transforms", "parallel", "models",
            "data", "train", "study", "lab")  # fmt: skip


def public_names(package: str | None = None) -> list[str]:
    """The ``__all__`` of ``jaxcomp`` (``None``) or of ``jaxcomp.<package>``, the top level's
    subpackages left out (they have pages of their own)."""
    module = importlib.import_module("jaxcomp" + (f".{package}" if package else ""))
    return [n for n in module.__all__ if package or n not in PACKAGES]


def _data_doc(module, name: str) -> list[str]:
    """The ``#:`` comment of a constant, from the submodule of ``module`` that defines it.

    Only the modules that hold the constant itself are parsed (a third of the submodules
    parsed here were read by nothing else in the build)."""
    from sphinx.pycode import ModuleAnalyzer

    names = [module.__name__]
    if hasattr(module, "__path__"):
        names += [f"{module.__name__}.{m.name}" for m in pkgutil.iter_modules(module.__path__)]
    value = getattr(module, name)
    for modname in names:
        if getattr(sys.modules.get(modname), name, None) is not value:
            continue  # not imported, or no such name there: it cannot define this constant
        try:
            docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
        except Exception:  # a module the analyzer cannot read has no comment to give
            continue
        if ("", name) in docs:
            return [line for line in docs[("", name)] if line]
    return []


def _page(package: str | None, seen: dict[int, str]) -> str:
    """One reST page: the package's docstring, then each public name (an object exported by
    two packages is described once and referenced from the other)."""
    qual = "jaxcomp" + (f".{package}" if package else "")
    module = importlib.import_module(qual)
    title = f"``{qual}``"
    lines = [title, "=" * len(title), "", f".. automodule:: {qual}", ""]
    for name in public_names(package):
        obj = getattr(module, name)
        if inspect.isclass(obj) or callable(obj):
            kind = "class" if inspect.isclass(obj) else "function"
            if id(obj) in seen:
                lines += [f".. py:{kind}:: {name}", f"   :module: {qual}", ""]
                lines += [f"   The same object as :py:obj:`{seen[id(obj)]}`.", ""]
                continue
            seen[id(obj)] = f"{qual}.{name}"
            lines += [f".. auto{kind}:: {qual}.{name}"]
            if kind == "class" and not issubclass(obj, BaseException):
                lines += ["   :members:"]
            lines += [""]
        else:
            lines += [f".. py:data:: {name}", f"   :module: {qual}"]
            lines += [f"   :type: {type(obj).__name__}"]
            value = repr(obj)
            lines += [f"   :value: {value}"] if len(value) <= 100 and "\n" not in value else []
            lines += ["", *[f"   {line}" for line in _data_doc(module, name)], ""]
    return "\n".join(lines)


def write_sources(src: pathlib.Path) -> None:
    """``conf.py``, the index, one page per package and the notebooks, into ``src``."""
    if src.exists():
        shutil.rmtree(src)
    (src / "notebooks").mkdir(parents=True)
    shutil.copy2(HERE / "conf.py", src / "conf.py")
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    for nb in notebooks:
        shutil.copy2(nb, src / "notebooks" / nb.name)
    pages, seen = ["jaxcomp", *PACKAGES], {}
    for page, package in zip(pages, (None, *PACKAGES)):
        (src / f"{page}.rst").write_text(_page(package, seen))
    index = [
        "jaxcomp API reference",
        "=====================",
        "",
        "Every public name, from its docstring; the notebooks with their outputs.",
        "",
        ".. toctree::",
        "   :maxdepth: 1",
        "   :caption: API",
        "",
        *[f"   {p}" for p in pages],
        "",
        ".. toctree::",
        "   :maxdepth: 1",
        "   :caption: Notebooks",
        "",
        *[f"   notebooks/{nb.stem}" for nb in notebooks],
        "",
    ]
    (src / "index.rst").write_text("\n".join(index))


def build(outdir: str | pathlib.Path = HERE / "_build") -> int:
    """Writes the sources and builds the HTML site into ``outdir/html``; returns Sphinx's exit
    code (non-zero on any warning)."""
    from sphinx.cmd.build import build_main

    out = pathlib.Path(outdir).resolve()
    write_sources(out / "src")
    args = ["-W", "--keep-going", "-q", "-b", "html", "-d", str(out / "doctrees")]
    return build_main([*args, str(out / "src"), str(out / "html")])


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(build(*sys.argv[1:2]))
