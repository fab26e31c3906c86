"""Shared helpers for the operator's unit tests: the CRD's schema applies the defaults, as the
API server would, so builders are tested on the same specs they get in a cluster."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "agentserving.io_agentservings.yaml"
EXAMPLES = sorted((REPO / "examples").glob("agentserving-*.yaml"))


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def spec_schema() -> dict[str, Any]:
    return load_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Structural-schema defaulting: fill missing properties that have a default, then recurse
    (so the defaults of a defaulted `{}` object apply too)."""
    if isinstance(value, dict) and schema.get("type") == "object":
        for name, prop in (schema.get("properties") or {}).items():
            if name not in value and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
            if name in value:
                value[name] = apply_defaults(value[name], prop)
    elif isinstance(value, list) and schema.get("type") == "array":
        return [apply_defaults(v, schema.get("items") or {}) for v in value]
    return value


def defaulted(spec: dict[str, Any]) -> dict[str, Any]:
    return apply_defaults(copy.deepcopy(spec), spec_schema())


def make_instance(spec: dict[str, Any] | None = None, name: str = "demo",
                  namespace: str = "ns1"):
    from agentserving.operator.builders import Instance

    return Instance(name=name, namespace=namespace, uid="uid-1234",
                    spec=defaulted(spec or {"model": {"name": "tiny"}}))


def vllm_serve_of(container: dict[str, Any]) -> dict[str, Any]:
    """What an ``agentserving worker --engine vllm`` container runs: its command parsed by the
    real worker CLI, which prints the ``vllm serve`` argv and environment it would exec."""
    import json

    from click.testing import CliRunner

    from agentserving.core.cli import main

    cmd = container["command"]
    assert cmd[:2] == ["agentserving", "worker"], cmd
    result = CliRunner().invoke(main, [*cmd[1:], "--print-command"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)
