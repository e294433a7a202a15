"""Sphinx configuration of the API reference (built by ``python docs/api/build.py``)."""

import jaxcomp

project = "jaxcomp"
release = version = jaxcomp.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_nb"]
# the docstrings are Google style (Args/Returns/Raises) with reStructuredText inline markup
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": False, "undoc-members": False}
# notebooks are shown with the outputs they are committed with (the suite executes them)
nb_execution_mode = "off"
html_theme = "alabaster"
html_theme_options = {"nosidebar": False}
exclude_patterns = ["_build"]
suppress_warnings = ["myst.header"]  # a notebook may open at heading level 2
