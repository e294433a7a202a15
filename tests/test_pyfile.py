"""Config and study files are run from their source as it is now."""

import os

from jaxcomp import _pyfile


def test_a_file_edited_within_its_mtime_and_size_is_run_as_edited(tmp_path):
    path = tmp_path / "edited.py"
    path.write_text("VALUE = 5\n")
    stat = path.stat()
    assert _pyfile.run_file(path, "edited").VALUE == 5
    path.write_text("VALUE = 6\n")  # the same size; the same mtime, as within one second
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    module = _pyfile.run_file(path, "edited")
    assert module.VALUE == 6
    assert module.__file__ == str(path) and module.__name__ == "edited"
