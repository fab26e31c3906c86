"""The CRD as a file: one source of truth, and a schema the API server will accept."""

from __future__ import annotations

import yaml

from .operator_testing import CRD_PATH, REPO, defaulted, load_crd, spec_schema

CHART_CRD = REPO / "charts" / "agentserving" / "crds" / CRD_PATH.name


def walk(schema, path="spec"):
    yield path, schema
    for name, prop in (schema.get("properties") or {}).items():
        yield from walk(prop, f"{path}.{name}")
    if schema.get("items"):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}.*")


def test_chart_crd_is_the_same_file():
    assert CHART_CRD.read_bytes() == CRD_PATH.read_bytes()


def test_schema_is_structural():
    """Every node has a type (or preserves unknown fields), as apiextensions/v1 requires."""
    for path, node in walk(spec_schema()):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        if node.get("type") == "object" and not node.get("x-kubernetes-preserve-unknown-fields"):
            assert "properties" in node or "additionalProperties" in node, path


def test_defaults_are_valid_enum_members():
    for path, node in walk(spec_schema()):
        if "default" in node and "enum" in node:
            assert node["default"] in node["enum"], path


def test_defaults_fill_every_field_the_builders_read():
    spec = defaulted({"model": {"name": "tiny"}})
    assert spec["engine"]["type"] == "reference"
    assert spec["kvCache"]["chunkSize"] == 256
    # the operator picks the engine's own (with_engine_defaults)
    assert "hashScheme" not in spec["kvCache"]
    assert spec["kvCache"]["prefetch"] == {}
    for pool in ("prefill", "decode"):
        assert spec[pool]["replicas"] == 1
        assert spec[pool]["accelerator"] == {"type": "cpu", "count": 1}
        assert spec[pool]["tensorParallelSize"] == 1
        assert "schedulerPolicy" not in spec[pool]
    assert spec["proxy"] == {"replicas": 1, "routing": "kv-aware", "serviceType": "ClusterIP"}
    assert spec["kvindex"] == {"replicas": 1, "redis": {"inCluster": False}}


def test_enums_match_the_contracts():
    props = spec_schema()["properties"]
    assert props["engine"]["properties"]["type"]["enum"] == ["reference", "vllm", "vllm-ascend"]
    assert props["proxy"]["properties"]["routing"]["enum"] == ["kv-aware", "session",
                                                               "round-robin"]
    from agentserving.core.hashing import CHUNK_HASH_SCHEMES

    assert props["kvCache"]["properties"]["hashScheme"]["enum"] == [
        s.value for s in CHUNK_HASH_SCHEMES]
    assert props["decode"]["properties"]["accelerator"]["properties"]["type"]["enum"] == [
        "cpu", "nvidia", "ascend"]


def test_printer_columns_and_subresources_point_at_real_fields():
    version = load_crd()["spec"]["versions"][0]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for col in version["additionalPrinterColumns"]:
        parts = col["jsonPath"].lstrip(".").split(".")
        if parts[0] == "status":
            assert parts[1] in status, col
            if len(parts) > 2:
                assert parts[2] in status[parts[1]]["properties"], col
        elif parts[0] == "spec":
            assert parts[1] in spec_schema()["properties"], col
    scale = version["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.decode.replicas"
    assert "selector" in status["decode"]["properties"]
    assert version["subresources"]["status"] == {}


def test_crd_is_one_yaml_document():
    docs = [d for d in yaml.safe_load_all(CRD_PATH.read_text()) if d]
    assert len(docs) == 1 and docs[0]["kind"] == "CustomResourceDefinition"


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys; the API server's and Helm's decoders refuse
    the document. So a duplicate is an error here too."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        dups = sorted({k for k in keys if keys.count(k) > 1})
        assert not dups, f"line {node.start_mark.line + 1}: duplicate keys {dups}"
        return super().construct_mapping(node, deep)


def test_crd_and_examples_have_no_duplicate_keys():
    from .operator_testing import EXAMPLES

    for path in [CRD_PATH, *EXAMPLES, REPO / "charts" / "agentserving" / "values.yaml"]:
        yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # a SafeLoader


def test_scheduler_policy_enum_is_the_workers_policy_registry():
    """One list of policy names: what the worker's --scheduler-policy builds."""
    from agentserving.engine.scheduler.registry import make_policy, policy_names
    from agentserving.operator.builders import ENGINES
    from agentserving.operator.builders.common import (
        ENGINE_PREFETCH_POLICIES,
        ENGINE_SCHEDULER_POLICIES,
    )

    props = spec_schema()["properties"]
    for pool in ("prefill", "decode"):
        node = props[pool]["properties"]["schedulerPolicy"]
        assert sorted(node["enum"]) == policy_names()
        assert "default" not in node  # per engine: with_engine_defaults
    for name in policy_names():
        make_policy(name, 512)
    assert set(ENGINE_SCHEDULER_POLICIES) == set(ENGINES)
    assert set(ENGINE_SCHEDULER_POLICIES.values()) <= set(policy_names())
    prefetch = props["kvCache"]["properties"]["prefetch"]["properties"]["policy"]["enum"]
    assert set(ENGINE_PREFETCH_POLICIES) == set(ENGINES)
    assert set(ENGINE_PREFETCH_POLICIES.values()) <= set(prefetch)
