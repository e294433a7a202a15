"""The API reference: ``python docs/api/build.py`` builds with no Sphinx warning, documents
every public name, and renders every notebook."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parents[1]


def _build_module():
    spec = importlib.util.spec_from_file_location("jaxcomp_docs_build", ROOT / "docs/api/build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_subpackage_has_a_page():
    """The build's pages come from ``PACKAGES``: a public subpackage left out of it has its
    names in no page, and the Sphinx test below, which takes its names from ``PACKAGES`` too,
    cannot see that (``jaxcomp.lab``'s 16 names until 2026-12-05)."""
    import types

    import jaxcomp

    build = _build_module()
    subpackages = {n for n in jaxcomp.__all__ if isinstance(getattr(jaxcomp, n), types.ModuleType)}
    assert subpackages == set(build.PACKAGES), sorted(subpackages ^ set(build.PACKAGES))


@pytest.mark.slow  # a whole Sphinx build
def test_api_reference_builds_without_warnings_and_lists_every_public_name(tmp_path):
    from sphinx.util.inventory import InventoryFile

    build = _build_module()
    assert build.build(tmp_path) == 0  # -W: any warning fails the build
    with open(tmp_path / "html" / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", lambda base, uri: uri)
    documented = {name for kind, items in inventory.items() if kind.startswith("py:")
                  for name in items}  # fmt: skip
    expected = {f"jaxcomp.{n}" for n in build.public_names()}
    for package in build.PACKAGES:
        expected |= {f"jaxcomp.{package}.{n}" for n in build.public_names(package)}
    assert len(expected) > 200 and not expected - documented, sorted(expected - documented)
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        page = (tmp_path / "html" / "notebooks" / f"{nb.stem}.html").read_text()
        assert "<img" in page, nb.stem  # the committed outputs, figures included
