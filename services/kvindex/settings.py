"""The kvindex's configuration: built from CLI flags / environment by ``cli.py``, then passed
to constructors. No other module reads the environment."""

from __future__ import annotations

from pydantic import BaseModel, Field


class KvindexSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(default=8300, ge=0, le=65535)
    store: str = Field(default="memory", description="'memory' or a redis:// URL.")
    redis_min_acks: int = Field(
        default=0, ge=0, description="Redis replicas that must hold a write before the "
        "kvindex acknowledges it (WAIT); 0: the master's word is enough.")
    lease_ttl_s: float = Field(default=15.0, gt=0)
    reap_interval_s: float = Field(default=1.0, gt=0)
    change_feed_max: int = Field(
        default=10_000, gt=0, description="Residency changes the feed keeps for followers "
        "(the proxies' replicas); one that falls further behind lists again.")
    max_batch_chunks: int = Field(default=65536, gt=0)
    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    fanout_timeout_s: float = Field(default=2.0, gt=0)
    session_idle_ttl_s: float = Field(
        default=3600.0, ge=0, description="Seconds after its last write that an agent session "
        "expires (its references stop protecting chunks from eviction, then the reaper drops "
        "it); a pin extends it. 0: sessions never expire idle."
    )
    stored_response_ttl_s: float = Field(
        default=86400.0, gt=0, description="Seconds a stored response (Responses API, "
        "store: true) is kept when the proxy names no TTL, and the most any is kept.")
    max_stored_response_bytes: int = Field(
        default=4 * 1024 * 1024, gt=0, description="Largest stored response, serialized "
        "(the response and its conversation's messages); more: 413.")
    max_stored_responses: int = Field(
        default=100_000, gt=0, description="Stored responses kept at most, across tenants; "
        "past it the oldest written goes first.")
    vllm_event_endpoints: dict[str, str] = Field(
        default_factory=dict, description="pod name -> ZMQ PUB endpoint of a vLLM KV event stream"
    )
    lmcache_controller: str | None = Field(
        default=None, description="Bind LMCache's controller worker endpoint here (ZMQ PULL, "
        "tcp://HOST:PORT); its ROUTER (requests) binds lmcache_controller_reply or PORT+1."
    )
    lmcache_controller_reply: str | None = Field(
        default=None, description="ZMQ ROUTER endpoint for LMCache workers' requests."
    )
    lmcache_instance_pods: dict[str, str] = Field(
        default_factory=dict, description="LMCache instance id -> pod name (default: same)"
    )
    internal_token: str | None = Field(
        default=None, repr=False, description="core.internal_auth: required on every /v1 "
        "route, sent to the pods' memory APIs.")
    log_level: str = "info"
    log_json: bool = True

    @property
    def idle_ttl_s(self) -> float | None:
        """The idle TTL as the session stores take it: None for never."""
        return self.session_idle_ttl_s or None

    def redis_options(self) -> dict[str, int]:
        """What the Redis backends take from these settings."""
        return {"min_acks": self.redis_min_acks} if self.redis_min_acks else {}
