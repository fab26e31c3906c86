"""The handful of Kubernetes API calls the operator makes, on plain dicts.

Children are written with server-side apply (``application/apply-patch+yaml``, forced, one
field manager): applying the same manifest twice changes nothing, and a changed manifest
changes only the fields it owns. Reads return the API's JSON as dicts.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import kubernetes
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

# (apiVersion, kind) -> plural resource name
PLURALS = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("v1", "Service"): "services",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("apps/v1", "Deployment"): "deployments",
    ("agentserving.io/v1alpha1", "AgentServing"): "agentservings",
}


def resource_path(api_version: str, kind: str, namespace: str, name: str | None = None,
                  subresource: str | None = None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{quote(namespace)}/{PLURALS[(api_version, kind)]}"
    if name:
        path += f"/{quote(name)}"
    if subresource:
        path += f"/{subresource}"
    return path


def load_client_config() -> ApiClient:
    """In a pod: its ServiceAccount; elsewhere: $KUBECONFIG or ~/.kube/config."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return ApiClient()


class Kube:
    def __init__(self, api: ApiClient, field_manager: str, timeout_s: float = 30.0):
        self.api = api
        self.field_manager = field_manager
        self.timeout_s = timeout_s

    def request(self, method: str, path: str, *, query: list[tuple[str, Any]] | None = None,
                body: Any = None, content_type: str = "application/json") -> Any:
        method, url, headers, body, post = self.api.param_serialize(
            method, path, query_params=query or [],
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body, auth_settings=["BearerToken"])
        resp = self.api.call_api(method, url, headers, body, post,
                                 _request_timeout=self.timeout_s)
        data = resp.read()
        if not 200 <= resp.status < 300:
            raise ApiException(http_resp=resp, body=data.decode(errors="replace"), data=None)
        return json.loads(data) if data else None

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply: create or update obj; returns the object as stored."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        return self.request("PATCH", path, body=obj, content_type="application/apply-patch+yaml",
                            query=[("fieldManager", self.field_manager), ("force", "true")])

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", resource_path(api_version, kind, namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str,
             label_selector: str) -> list[dict[str, Any]]:
        data = self.request("GET", resource_path(api_version, kind, namespace),
                            query=[("labelSelector", label_selector)])
        return data.get("items") or []

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        try:
            self.request("DELETE", resource_path(api_version, kind, namespace, name),
                         body={"propagationPolicy": "Background"})
        except ApiException as e:
            if e.status != 404:
                raise

    def patch_status(self, api_version: str, kind: str, namespace: str, name: str,
                     status: dict[str, Any], resource_version: str | None = None) -> None:
        """JSON merge patch of the status subresource (None values remove fields). With
        resource_version, the write fails (409 Conflict) if the object changed since."""
        path = resource_path(api_version, kind, namespace, name, "status")
        body: dict[str, Any] = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        self.request("PATCH", path, body=body, content_type="application/merge-patch+json")
