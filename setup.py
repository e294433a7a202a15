"""What pyproject.toml cannot say: the top-level ``configs/`` ships in the wheel as the package
``jaxcomp.configs`` (read by ``jaxcomp._resources.configs_dir``), so configs run by name from an
installed wheel while the repository's ``configs/`` stays their only source."""

from setuptools import find_packages
from setuptools import setup

setup(
    packages=find_packages(include=["jaxcomp*"]) + ["jaxcomp.configs", "jaxcomp.configs.studies"],
    package_dir={"jaxcomp.configs": "configs"},
)
