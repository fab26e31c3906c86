"""Maps the folders of DESIGN.md into the one ``agentserving.*`` import namespace.

Everything else about the package is in pyproject.toml; only this map needs code, because
setuptools cannot discover sub-packages under a renamed folder by itself.
"""

from setuptools import find_packages, setup

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


def _packages() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = [], {}
    for name, folder in FOLDERS.items():
        packages.append(name)
        package_dir[name] = folder
        for sub in find_packages(folder, exclude=["tests", "tests.*", "*.tests", "*.tests.*"]):
            packages.append(f"{name}.{sub}")
            package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"
    return packages, package_dir


packages, package_dir = _packages()
setup(packages=packages, package_dir=package_dir, include_package_data=True)
