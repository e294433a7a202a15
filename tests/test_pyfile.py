"""Config and study files are run from their source as it is now."""

import os
import textwrap

from jaxcomp import _pyfile
from jaxcomp import main
from jaxcomp import study


def _edit(path, old, new):
    """Rewrites ``path`` from ``old`` to ``new`` (the same size) keeping its mtime, as an edit
    within one second does."""
    stat = path.stat()
    text = path.read_text()
    assert len(old) == len(new) and old in text
    path.write_text(text.replace(old, new))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_file_edited_within_its_mtime_and_size_is_run_as_edited(tmp_path):
    path = tmp_path / "edited.py"
    path.write_text("VALUE = 5\ndef f(x: int): return x\n")
    assert _pyfile.run_file(path, "edited").VALUE == 5
    _edit(path, "VALUE = 5", "VALUE = 6")
    module = _pyfile.run_file(path, "edited")
    assert module.VALUE == 6
    assert module.__file__ == str(path) and module.__name__ == "edited"
    assert module.f.__annotations__ == {"x": int}  # the file's own __future__ imports only


def test_the_config_and_study_loaders_read_the_edited_file(tmp_path):
    config = tmp_path / "cfg.py"
    config.write_text(
        "import ml_collections\n"
        "def get_config(arg):\n"
        "    return ml_collections.ConfigDict({'lr': 0.05})\n"
    )
    assert main.load_config(str(config)).lr == 0.05
    _edit(config, "0.05", "0.06")
    assert main.load_config(str(config)).lr == 0.06
    path = tmp_path / "tiny.py"
    path.write_text(
        textwrap.dedent('''
        """A study.

          python -m jaxcomp.study run tiny
        """
        CONFIG = "digits_dense"
        VARIANTS = {"dense": {"lr": 0.05}}
        ''')
    )
    assert study.load_study(str(path)).variants == {"dense": {"lr": 0.05}}
    _edit(path, "0.05", "0.06")
    assert study.load_study(str(path)).variants == {"dense": {"lr": 0.06}}
