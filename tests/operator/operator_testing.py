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


# ------------------------------------------------------------------ pods as the kubelet runs them

# The downward API of a pretend pod (what $(POD_NAME), $(POD_IP) expand to).
POD_FIELDS = {"metadata.name": "demo-prefill-0", "metadata.namespace": "ns1",
              "status.podIP": "10.1.2.3"}


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a variable of the container, else left as written."""
    import re

    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it (in order, references expanded)."""
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif "fieldRef" in (var.get("valueFrom") or {}):
            env[var["name"]] = POD_FIELDS[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def pod_argv(container: dict[str, Any]) -> list[str]:
    env = container_env(container)
    return [expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]


def containers_of(children: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(child name, container) for every container of every workload."""
    return [(child["metadata"]["name"], c) for child in children
            if child["kind"] in ("StatefulSet", "Deployment")
            for c in child["spec"]["template"]["spec"]["containers"]]


def parse_agentserving(container: dict[str, Any]) -> tuple[str, Any]:
    """(subcommand, settings) of an ``agentserving SUBCOMMAND`` container: its command line
    and its environment (AGENTSERVING_<SUBCOMMAND>_<FLAG>) parsed by the real click command,
    then its settings built and checked by the subcommand's own ``settings_from_params``
    (where it has none, the parameters click parsed and checked).
    Raises what the process would: click's usage errors, pydantic's validation errors."""
    import importlib
    import os
    from unittest import mock

    import click

    from agentserving.core.cli import main

    argv = pod_argv(container)
    assert argv[0] == "agentserving", argv
    sub = argv[1]
    env = container_env(container)
    root = click.Context(main, info_name="agentserving", auto_envvar_prefix="AGENTSERVING")
    command = main.get_command(root, sub)
    assert command is not None, f"no subcommand {sub!r}"
    prefix = f"AGENTSERVING_{sub.upper().replace('-', '_')}_"
    known = {f"{prefix}{p.name.upper()}" for p in command.params if p.name}
    unread = [k for k in env if k.startswith("AGENTSERVING_") and k not in known]
    assert not unread, f"{sub}: no option reads {unread}"
    with mock.patch.dict(os.environ, env, clear=True):
        ctx = command.make_context(sub, argv[2:], parent=root)
        module = importlib.import_module(command.callback.__module__)
        from_params = getattr(module, "settings_from_params", None)
        if from_params is None:  # a command that builds its settings from its parameters as-is
            return sub, dict(ctx.params)
        return sub, from_params(dict(ctx.params))
