from __future__ import annotations

import pytest

from agentserving.operator.builders import MANAGED_KINDS
from agentserving.operator.kube import PLURALS, resource_path


@pytest.mark.parametrize("api_version, kind, expected", [
    ("v1", "ConfigMap", "/api/v1/namespaces/ns/configmaps/x"),
    ("v1", "Service", "/api/v1/namespaces/ns/services/x"),
    ("apps/v1", "StatefulSet", "/apis/apps/v1/namespaces/ns/statefulsets/x"),
    ("apps/v1", "Deployment", "/apis/apps/v1/namespaces/ns/deployments/x"),
    ("agentserving.io/v1alpha1", "AgentServing",
     "/apis/agentserving.io/v1alpha1/namespaces/ns/agentservings/x"),
])
def test_resource_paths(api_version, kind, expected):
    assert resource_path(api_version, kind, "ns", "x") == expected


def test_status_and_collection_paths():
    assert resource_path("agentserving.io/v1alpha1", "AgentServing", "ns", "x", "status") == (
        "/apis/agentserving.io/v1alpha1/namespaces/ns/agentservings/x/status")
    assert resource_path("apps/v1", "Deployment", "ns") == "/apis/apps/v1/namespaces/ns/deployments"


def test_every_managed_kind_has_a_path():
    assert set(MANAGED_KINDS) <= set(PLURALS)
