"""The connector's settings: ``kv_connector_extra_config`` (flat keys; LMCache itself reads only
the ``lmcache.``-prefixed ones) over environment defaults. Parsing is pure, so a bad value is
reported naming its key before any server starts."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from agentserving.core.hashing import HashScheme
from agentserving.core.internal_auth import TOKEN_ENV
from agentserving.core.schemas import PodRole

KV_ROLE_POD_ROLES = {"kv_producer": PodRole.PREFILL, "kv_consumer": PodRole.DECODE,
                     "kv_both": PodRole.BOTH}


class ConnectorConfigError(ValueError):
    """A ``kv_connector_extra_config`` value the connector cannot use (names the key)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"kv_connector_extra_config.{key}: {message}")
        self.key = key


@dataclass(frozen=True)
class ConnectorSettings:
    pod_name: str
    public_host: str  # how other pods reach this one (the kvindex stores URLs built from it)
    memory_host: str = "0.0.0.0"
    memory_port_start: int = 6999  # scheduler process; worker (TP rank) k on start + 1 + k
    memory_api: bool = True
    chunk_hashes: bool = True
    kvindex_url: str | None = None
    api_port: int = 8000  # vLLM's OpenAI server (for the registration's api_url)
    hash_scheme: HashScheme = HashScheme.LMCACHE_BUILTIN
    report_interval_s: float = 0.5
    heartbeat_interval_s: float = 5.0
    pod_role: PodRole | None = None  # the kvindex role; None: from vLLM's kv_role
    handoff_timeout_s: float = 10.0  # prefill pods: longest wait for the remote KV writes
    metrics_max_tenants: int = 64  # the reuse metrics' tenant label cap (engine.metrics)
    # at most this share of the DRAM tier (LMCache) and of vLLM's device pool pinned at once
    pin_share: float = 0.5
    # the KV server this pod's LMCache writes to (its HTTP API): evictions reach it; with
    # kv_transfer_p2p it is the pod's own, which a decode pod's ranks read from (``handoff``)
    kv_server_api: str | None = None
    kv_transfer_p2p: bool = False
    kv_pull_timeout_s: float = 30.0
    # vLLM-CPU: LMCache's reloads copied into vLLM's pages layer by layer behind the forward
    # pass (paged_cpu); off: all of it in start_load_kv, before the forward
    layerwise_load: bool = True
    # core.internal_auth: from the environment only (kv_connector_extra_config is on vLLM's
    # command line, where every process on the host can read it)
    internal_token: str | None = field(default=None, repr=False)

    def worker_port(self, rank: int) -> int:
        return self.memory_port_start + 1 + rank

    def worker_urls(self, world_size: int, host: str = "127.0.0.1") -> list[str]:
        return [f"http://{host}:{self.worker_port(k)}" for k in range(world_size)]


_BOOL = TypeAdapter(bool)


def _bool(key: str, value: Any) -> bool:
    """vLLM hands the extra config through as JSON or strings: pydantic's booleans."""
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        raise ConnectorConfigError(key, f"expected a boolean, got {value!r}") from None


def _cast(key: str, value: Any, kind: type, expected: str) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConnectorConfigError(key, f"expected {expected}, got {value!r}") from None


def _port(key: str, value: Any) -> int:
    port = _cast(key, value, int, "a port number")
    if not 1 <= port <= 65535:
        raise ConnectorConfigError(key, f"port {port} out of range 1..65535")
    return port


def _positive(key: str, value: Any) -> float:
    out = _cast(key, value, float, "a number")
    if out <= 0:
        raise ConnectorConfigError(key, f"must be > 0, got {out}")
    return out


def _count(key: str, value: Any) -> int:
    out = _cast(key, value, int, "a whole number")
    if out < 0:
        raise ConnectorConfigError(key, f"must be >= 0, got {out}")
    return out


def _share(key: str, value: Any) -> float:
    out = _cast(key, value, float, "a number")
    if not 0 <= out <= 1:
        raise ConnectorConfigError(key, f"must be within 0..1, got {out}")
    return out


def parse_settings(extra: Mapping[str, Any] | None, env: Mapping[str, str]) -> ConnectorSettings:
    """Settings from ``kv_connector_extra_config`` (wins) and the pod's environment
    (``POD_NAME``, ``POD_IP``, ``AGENTSERVING_KVINDEX_URL``, ``AGENTSERVING_INTERNAL_TOKEN``)."""
    extra = dict(extra or {})
    host = socket.gethostname()
    pod = str(extra.get("pod_name") or env.get("POD_NAME") or host)
    kvindex = extra.get("kvindex_url", env.get("AGENTSERVING_KVINDEX_URL")) or None
    if kvindex is not None and not str(kvindex).startswith(("http://", "https://")):
        raise ConnectorConfigError("kvindex_url", f"expected an http(s) URL, got {kvindex!r}")
    scheme = extra.get("hash_scheme", HashScheme.LMCACHE_BUILTIN.value)
    try:
        scheme = HashScheme(scheme)
    except ValueError:
        raise ConnectorConfigError(
            "hash_scheme", f"{scheme!r} is not one of {[s.value for s in HashScheme]}") from None
    start = _port("memory_port_start", extra.get("memory_port_start", 6999))
    server_api = extra.get("kv_server_api") or None
    if server_api is not None and not str(server_api).startswith(("http://", "https://")):
        raise ConnectorConfigError("kv_server_api",
                                   f"expected an http(s) URL, got {server_api!r}")
    p2p = _bool("kv_transfer_p2p", extra.get("kv_transfer_p2p", False))
    if p2p and server_api is None:
        raise ConnectorConfigError("kv_transfer_p2p", "needs kv_server_api (the pod's own "
                                   "KV server)")
    role = extra.get("pod_role")
    try:
        role = PodRole(role) if role is not None else None
    except ValueError:
        raise ConnectorConfigError(
            "pod_role", f"{role!r} is not one of {[r.value for r in PodRole]}") from None
    return ConnectorSettings(
        pod_name=pod,
        public_host=str(extra.get("public_host") or env.get("POD_IP") or host),
        memory_host=str(extra.get("memory_host", "0.0.0.0")),
        memory_port_start=start,
        memory_api=_bool("memory_api", extra.get("memory_api", True)),
        chunk_hashes=_bool("chunk_hashes", extra.get("chunk_hashes", True)),
        kvindex_url=str(kvindex).rstrip("/") if kvindex else None,
        api_port=_port("api_port", extra.get("api_port", 8000)),
        hash_scheme=scheme,
        report_interval_s=_positive("report_interval_s", extra.get("report_interval_s", 0.5)),
        heartbeat_interval_s=_positive("heartbeat_interval_s",
                                       extra.get("heartbeat_interval_s", 5.0)),
        pod_role=role,
        handoff_timeout_s=_positive("handoff_timeout_s", extra.get("handoff_timeout_s", 10.0)),
        metrics_max_tenants=_count("metrics_max_tenants", extra.get("metrics_max_tenants", 64)),
        pin_share=_share("pin_share", extra.get("pin_share", 0.5)),
        kv_server_api=str(server_api).rstrip("/") if server_api else None,
        kv_transfer_p2p=p2p,
        kv_pull_timeout_s=_positive("kv_pull_timeout_s", extra.get("kv_pull_timeout_s", 30.0)),
        layerwise_load=_bool("layerwise_load", extra.get("layerwise_load", True)),
        internal_token=env.get(TOKEN_ENV) or None,
    )


def pod_role(kv_role: str | None) -> PodRole:
    return KV_ROLE_POD_ROLES.get(kv_role or "kv_both", PodRole.BOTH)
