"""Maps the folders of DESIGN.md into the one ``agentserving.*`` import namespace.

Everything else about the package is in pyproject.toml; only this map needs code, because
setuptools cannot discover sub-packages under a renamed folder by itself.

Every folder holding Python source is a package, ``__init__.py`` or not (a folder without one
was once left out of the wheel, and images died on import), except tests. Data files go in
only when code reads them at run time (``PACKAGE_DATA``): with ``include_package_data`` the
wheel's contents would depend on whether git and setuptools-scm are present at build time
(they are not in the Docker build), and tests would ship as data.
"""

from pathlib import Path

from setuptools import find_namespace_packages, setup

FOLDERS = {
    "agentserving.core": "core",
    "agentserving.kvindex": "services/kvindex",
    "agentserving.operator": "operator",
    "agentserving.engine": "engine",
    "agentserving.prefill": "services/prefill",
    "agentserving.decode": "services/decode",
    "agentserving.proxy": "services/proxy",
    "agentserving.replay": "replay",
    "agentserving.kernels": "kernels",
    "agentserving.sim": "sim",
}
TESTS = ["tests", "tests.*", "*.tests", "*.tests.*"]
# package -> files (globs, relative to the package) its code opens at run time
PACKAGE_DATA = {
    "agentserving.sim": ["profiles/*.yaml"],  # sim.profile.PROFILE_DIR
    "agentserving.replay": ["workloads/*.jsonl"],  # replay.loader.WORKLOADS (bundled:NAME)
}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = [], {}
    for name, folder in FOLDERS.items():
        packages.append(name)
        package_dir[name] = folder
        for sub in find_namespace_packages(folder, exclude=TESTS):
            path = f"{folder}/{sub.replace('.', '/')}"
            if any(Path(path).glob("*.py")):  # a data folder (sim/profiles) is no package
                packages.append(f"{name}.{sub}")
                package_dir[f"{name}.{sub}"] = path
    return packages, package_dir


packages, package_dir = _packages()
setup(packages=packages, package_dir=package_dir, package_data=PACKAGE_DATA,
      include_package_data=False)
