"""Dockerfiles and the chart agree with the package: extras, entry point, images."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

from agentserving.operator.settings import OperatorSettings

from .operator_testing import REPO

UNITS = ["operator", "proxy", "kvindex", "worker"]


@pytest.mark.parametrize("unit", UNITS)
def test_dockerfile_installs_its_extra_and_runs_agentserving(unit):
    dockerfile = (REPO / "docker" / f"{unit}.Dockerfile").read_text()
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert unit in extras
    assert f"[{unit}]" in dockerfile
    assert 'ENTRYPOINT ["agentserving"]' in dockerfile
    assert re.search(r"^USER 65532", dockerfile, re.M)
    assert (REPO / "docker" / f"{unit}.Dockerfile.dockerignore").exists()
    if unit != "worker":
        assert not re.search(r"^RUN .*torch", dockerfile, re.M)
    else:
        assert 'torch==${TORCH_VERSION}"' in dockerfile


def test_default_images_are_the_ones_the_dockerfiles_build():
    settings = OperatorSettings()
    for unit in ("worker", "proxy", "kvindex"):
        tag_line = f"-t {settings.image(unit)} ."
        assert tag_line in (REPO / "docker" / f"{unit}.Dockerfile").read_text()


def test_chart_values_match_operator_defaults():
    values = yaml.safe_load((REPO / "charts" / "agentserving" / "values.yaml").read_text())
    chart = yaml.safe_load((REPO / "charts" / "agentserving" / "Chart.yaml").read_text())
    settings = OperatorSettings()
    assert values["components"]["imageRegistry"] == settings.image_registry
    assert chart["appVersion"] == settings.image_tag
    assert values["components"]["redisImage"] == settings.redis_image
    assert values["components"]["vllmImage"] == settings.vllm_image
    assert f"-t {values['image']['repository']}:{chart['appVersion']} ." in (
        REPO / "docker" / "operator.Dockerfile").read_text()


def test_operator_renders_with_its_image_dependencies_only():
    """The operator renders command lines through the services' own settings and click
    commands: importing those must not pull what only the services' images install."""
    import json
    import subprocess
    import sys

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    others = {d for unit in ("service", "kvindex", "proxy", "worker", "replay", "kernels")
              for d in extras[unit] if not d.startswith("agentserving")}
    script = """
import json, sys, yaml
sys.path.insert(0, sys.argv[1])
from operator_testing import EXAMPLES, defaulted
from agentserving.operator.builders import Instance, build_children
from agentserving.operator.settings import OperatorSettings
for path in EXAMPLES:
    doc = yaml.safe_load(path.read_text())
    build_children(Instance("x", "ns", "u", defaulted(doc["spec"])), OperatorSettings())
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""
    out = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent)],
                         capture_output=True, text=True, check=True, cwd="/").stdout
    loaded = set(json.loads(out))
    import_names = {"pyzmq": "zmq", "pyyaml": "yaml", "py-cpuinfo": "cpuinfo",
                    "opentelemetry-api": "opentelemetry", "opentelemetry-sdk": "opentelemetry",
                    "setuptools_scm": "setuptools_scm"}
    forbidden = {import_names.get(n, n.replace("-", "_"))
                 for n in (re.split(r"[<>=\[ ]", d)[0] for d in others)}
    forbidden -= {"yaml"}  # the operator's own extra has it
    assert not loaded & forbidden, sorted(loaded & forbidden)
