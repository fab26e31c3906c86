"""Dockerfiles and the chart agree with the package: extras, entry point, images."""

from __future__ import annotations

import re
import tomllib

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
