"""Every field of the AgentServing CRD reaches something: walk the spec's schema and, for each
leaf, render each example (and the all-defaults resource) with that field changed to another
valid value. The rendered children (pod commands, environment, ConfigMaps, workloads,
Services) must change, or the operator must refuse the value naming a rule (SpecError);
every render that succeeds must still parse with the real CLIs of its processes. A field
that changes nothing anywhere is dead and belongs out of the CRD; one that changes nothing
in some resource must be listed in ``UNUSED_WHEN`` with the reason."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import yaml

from agentserving.operator.builders import Instance, SpecError, build_children
from agentserving.operator.settings import OperatorSettings

from .operator_testing import EXAMPLES, containers_of, defaulted, parse_agentserving, spec_schema

BASES = {p.name: yaml.safe_load(p.read_text())["spec"] for p in EXAMPLES}
BASES["defaults"] = {"model": {"name": "tiny"}}  # the CRD's and the operator's defaults

# Values for leaves whose type alone does not give a valid one (patterns, free-form objects
# and lists); POOL stands for prefill and decode.
SAMPLES: dict[str, list[Any]] = {
    "model.name": ["/models/other-model", "org/other-model"],
    "engine.args": [["--max-running-requests", "8"]],
    "engine.env": [[{"name": "EXTRA", "value": "1"}]],
    "POOL.accelerator.resourceName": ["example.com/accelerator"],
    "POOL.nodeSelector": [{"disk": "ssd"}],
    "POOL.tolerations": [[{"key": "k", "operator": "Exists", "effect": "NoSchedule"}]],
    "POOL.resources": [{"requests": {"cpu": "3"}}],
    "proxy.resources": [{"requests": {"cpu": "3"}}],
    "kvindex.resources": [{"requests": {"cpu": "3"}}],
    "kvindex.redis.url": ["redis://other.example:6379/1"],
    "kvCache.transferGiB": [4, 0.5],
}

# Leaves that legitimately change nothing in some resources: key -> (when, why).
UNUSED_WHEN = {
    "POOL.accelerator.count": (lambda spec, pool: spec[pool]["accelerator"]["type"] == "cpu",
                               "a cpu pool requests no accelerators"),
    "POOL.accelerator.resourceName": (
        lambda spec, pool: spec[pool]["accelerator"]["type"] == "cpu",
        "a cpu pool requests no accelerators"),
    "kvindex.redis.image": (lambda spec, _: not spec["kvindex"]["redis"].get("inCluster"),
                            "no in-cluster Redis runs"),
    "kvindex.redis.replicas": (lambda spec, _: not spec["kvindex"]["redis"].get("inCluster"),
                               "no in-cluster Redis runs (2+ members are refused)"),
    "kvCache.diskVolume.medium": (
        lambda spec, _: bool(spec["kvCache"]["diskVolume"].get("storageClassName")),
        "a PersistentVolumeClaim holds the disk tier, not an emptyDir"),
    "kvCache.transferGiB": (lambda spec, _: spec["kvCache"]["transferBackend"] == "tcp",
                            "no KV server runs: the hand-off goes pod to pod over tcp"),
}

# Leaves whose every other value each resource refuses (SpecError): key -> why the field stays.
ONLY_ONE_VALID: dict[str, str] = {}


def leaves(node: dict[str, Any], path: tuple[str, ...] = ()):
    props = node.get("properties")
    if node.get("type") == "object" and props and not node.get(
            "x-kubernetes-preserve-unknown-fields"):
        for name, prop in props.items():
            yield from leaves(prop, (*path, name))
    else:
        yield path, node


def key_of(path: tuple[str, ...]) -> str:
    return ".".join(("POOL" if p in ("prefill", "decode") and i == 0 else p)
                    for i, p in enumerate(path))


MISSING = object()


def get(spec: dict[str, Any], path: tuple[str, ...]) -> Any:
    for p in path:
        if not isinstance(spec, dict) or p not in spec:
            return MISSING
        spec = spec[p]
    return spec


def with_value(spec: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(spec)
    node = out
    for p in path[:-1]:
        node = node.setdefault(p, {})
    node[path[-1]] = copy.deepcopy(value)
    return out


def candidates(path: tuple[str, ...], node: dict[str, Any], current: Any) -> list[Any]:
    """Other valid values of the leaf (any valid value when it is unset and has no default)."""
    key = key_of(path)
    if key in SAMPLES:
        return [v for v in SAMPLES[key] if v != current]
    if current is MISSING:
        current = node.get("default", MISSING)
    unset = current is MISSING
    if "enum" in node:
        return [v for v in node["enum"] if unset or v != current]
    kind = node["type"]
    if kind == "boolean":
        return [True] if unset else [not current]
    if kind == "integer":
        lo, hi = node.get("minimum", 0), node.get("maximum", 1 << 20)
        step = node.get("multipleOf", 1)
        base = lo if unset else current
        values = [base * 2, base + step, base - step, lo, hi] + ([base] if unset else [])
        return sorted({v for v in values if lo <= v <= hi and v % step == 0
                       and (unset or v != current)}, key=values.index)
    if kind == "string":
        return ["changed"] if unset else [f"{current}-changed"]
    raise AssertionError(f"spec.{key}: no sample value for a {kind} (add one to SAMPLES)")


def render(spec: dict[str, Any]) -> list[dict[str, Any]]:
    children = build_children(Instance("demo", "ns1", "uid-1", defaulted(spec)),
                              OperatorSettings())
    for _, container in containers_of(children):  # what renders must also run
        if container.get("command", [""])[0] == "agentserving":
            parse_agentserving(container)
    return children


def effective(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec as the builders see it: the CRD's defaults, then the operator's per engine."""
    return Instance("demo", "ns1", "uid-1", defaulted(spec)).spec


@functools.cache
def rendered_base(name: str) -> list[dict[str, Any]]:
    return render(BASES[name])


def outcome(name: str, path: tuple[str, ...], node: dict[str, Any]) -> str:
    base, before = BASES[name], rendered_base(name)
    seen = []
    for value in candidates(path, node, get(effective(base), path)):
        try:
            after = render(with_value(base, path, value))
        except SpecError:
            seen.append("rejected")
            continue
        if after != before:
            return "changed"
        seen.append("same")
    return "rejected" if seen and set(seen) == {"rejected"} else "same"


LEAVES = list(leaves(spec_schema()))


def test_the_walk_sees_every_section():
    keys = {key_of(p) for p, _ in LEAVES}
    assert {"model.name", "engine.type", "POOL.tensorParallelSize", "POOL.schedulerPolicy",
            "kvCache.transferBackend", "kvCache.prefetch.policy", "kvCache.prefetch.lookahead",
            "proxy.routing", "kvindex.redis.url"} <= keys
    assert set(SAMPLES) <= keys and set(UNUSED_WHEN) <= keys and set(ONLY_ONE_VALID) <= keys


@pytest.mark.parametrize("path, node", LEAVES, ids=[".".join(p) for p, _ in LEAVES])
def test_every_crd_field_changes_what_its_process_does(path, node):
    outcomes = {name: outcome(name, path, node) for name in BASES}
    field = "spec." + ".".join(path)
    if key_of(path) in ONLY_ONE_VALID:
        assert set(outcomes.values()) == {"rejected"}, (field, outcomes)
        return
    assert "changed" in outcomes.values(), f"{field} changes nothing anywhere: {outcomes}"
    for name, result in outcomes.items():
        if result != "same":
            continue
        when = UNUSED_WHEN.get(key_of(path))
        assert when and when[0](effective(BASES[name]), path[0]), (
            f"{field} changes nothing in {name} (neither the children nor a refusal)")
