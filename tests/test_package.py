"""The release: an sdist and a wheel built from the sources, checked by twine, and the wheel
installed (not editable) into a fresh virtualenv, where the main job runs by config name from a
directory that is not the checkout."""

import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

import jaxcomp

#: a build, twine and a fresh virtualenv: subprocesses of seconds each
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).parents[1]
#: what the sdist is built from: the files a release needs, copied so that the build writes
#: nothing into the checkout (setuptools puts build/ and *.egg-info beside its sources)
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "CHANGELOG.md")


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> pathlib.Path:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("jaxcomp", "configs"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    out = tmp_path_factory.mktemp("dist")
    # the wheel is built from the sdist (build's default): a file the sdist lacks fails here
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def test_sdist_and_wheel_pass_twine_check_and_carry_configs_and_types(dist):
    version = jaxcomp.__version__
    wheel = dist / f"jaxcomp-{version}-py3-none-any.whl"
    sdist = dist / f"jaxcomp-{version}.tar.gz"
    assert wheel.exists() and sdist.exists(), sorted(os.listdir(dist))
    check = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0 and check.stdout.count("PASSED") == 2, check.stdout
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = sorted(p.name for p in (ROOT / "configs").glob("*.py"))
    studies = sorted(p.name for p in (ROOT / "configs" / "studies").glob("*.py"))
    assert "jaxcomp/py.typed" in names
    assert {f"jaxcomp/configs/{n}" for n in configs} <= names
    assert {f"jaxcomp/configs/studies/{n}" for n in studies} <= names
    assert not [n for n in names if n.startswith(("tests/", "configs/"))]
    in_sdist = set(tarfile.open(sdist).getnames())
    assert f"jaxcomp-{version}/CHANGELOG.md" in in_sdist
    assert f"jaxcomp-{version}/configs/digits_pipeline.py" in in_sdist


def test_installed_wheel_runs_the_main_job_by_config_name(dist, tmp_path):
    """A fresh virtualenv holding only the wheel; its dependencies come from this environment's
    site-packages through a path file (a plain path: the editable install's hooks there are
    not run, so ``jaxcomp`` can only come from the wheel)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    deps = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    pathlib.Path(site, "_deps_from_the_test_env.pth").write_text("\n".join(deps) + "\n")
    wheel = dist / f"jaxcomp-{jaxcomp.__version__}-py3-none-any.whl"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-index", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    env["XLA_FLAGS"] = "--xla_cpu_use_fusion_emitters=false"  # tests/conftest.py: fast_compiles
    where = tmp_path / "elsewhere"
    where.mkdir()
    # one interpreter (one import of JAX): where jaxcomp comes from, then the main job as
    # `python -m jaxcomp.main` runs it (runpy, as ``__main__``, its exit status), by an unknown
    # name and by a config's; the `python -m` launch itself: tests/test_main.py, test_faults.py
    run = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m, runpy, sys, jaxcomp; "
         "print(jaxcomp.__file__, jaxcomp.__version__, m.version('jaxcomp'), flush=True)\n"
         "def main(*argv):\n"
         "    sys.argv = ['jaxcomp.main', '--config', *argv]\n"
         "    runpy.run_module('jaxcomp.main', run_name='__main__', alter_sys=True)\n"
         "try:\n"
         "    main('digits_pipelin', '--workdir', 'V')\n"
         "except SystemExit as e:\n"
         "    print('unknown name:', e.code, flush=True)\n"
         "main('digits_dense:smoke', '--workdir', 'W')"],
        cwd=where, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = run.stdout.splitlines()
    path, version, metadata = lines[0].split()
    assert path.startswith(site) and version == metadata == jaxcomp.__version__
    assert lines[1] == "unknown name: 2" and "unknown config 'digits_pipelin'" in run.stderr
    assert "digits_pipeline," in run.stderr and not (where / "V").exists()
    assert run.returncode == 0, run.stderr[-2000:]
    assert "summary: dense / mlp" in run.stdout and (where / "W" / "summary.json").exists()
