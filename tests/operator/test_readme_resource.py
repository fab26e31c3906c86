"""The `AgentServing` resource the README shows is one the operator accepts, and the OpenAI
endpoint the README names (`<name>-proxy`, port 8080) is the Service it renders."""

from __future__ import annotations

import re
from typing import Any

import yaml

from agentserving.operator.builders import Instance, build_children
from agentserving.operator.settings import OperatorSettings

from .operator_testing import REPO, defaulted, spec_schema


def readme_resource() -> dict[str, Any]:
    readme = (REPO / "README.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", readme, re.S)]
    found = [b for b in blocks if isinstance(b, dict) and b.get("kind") == "AgentServing"]
    assert len(found) == 1, "the README shows one AgentServing resource"
    return found[0]


def unknown_fields(value: Any, schema: dict[str, Any], where: str = "spec") -> list[str]:
    """Fields the CRD's structural schema would prune: a typo the API server drops silently."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        return []
    props = schema.get("properties") or {}
    if not props:
        return []
    out = []
    for name, v in value.items():
        if name not in props:
            out.append(f"{where}.{name}")
        else:
            out += unknown_fields(v, props[name], f"{where}.{name}")
    return out


def test_the_readme_resource_uses_only_crd_fields() -> None:
    res = readme_resource()
    assert res["apiVersion"] == "agentserving.io/v1alpha1"
    assert unknown_fields(res["spec"], spec_schema()) == []


def test_the_readme_resource_renders_and_serves_openai_on_its_proxy_service() -> None:
    res = readme_resource()
    name = res["metadata"]["name"]
    children = build_children(Instance(name, "default", "uid-1", defaulted(res["spec"])),
                              OperatorSettings())
    services = {c["metadata"]["name"]: c for c in children if c["kind"] == "Service"}
    assert f"{name}-proxy" in services
    assert 8080 in [p["port"] for p in services[f"{name}-proxy"]["spec"]["ports"]]
    readme = (REPO / "README.md").read_text()
    assert f"svc/{name}-proxy 8080:8080" in readme
