"""What a local fleet is made of: kvindex, workers and proxy as process specs on loopback.

``FleetSpec`` says how many prefill, decode and both-role workers, which kvindex store, which
routing and cache settings; ``build(spec)`` picks free loopback ports and returns the
``ProcessSpec`` of every process, in start order, with the command lines of
``agentserving kvindex``, ``agentserving worker`` and ``agentserving proxy``, each rendered
from that service's own settings through its own command (``core.argv``), as the operator
renders its pods': a flag the command lacks or a value its settings refuse fails here.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agentserving.core.argv import settings_argv
from agentserving.core.hashing import DEFAULT_CHUNK_SIZE, ENGINE_HASH_SCHEMES, HashScheme
from agentserving.core.internal_auth import TOKEN_ENV
from agentserving.core.ports import bindable, pickable_ports
from agentserving.engine.cli import command as worker_command
from agentserving.engine.settings import WorkerSettings
from agentserving.engine.vllm.registrar_cli import argv as registrar_argv
from agentserving.kvindex.cli import command as kvindex_command
from agentserving.kvindex.settings import KvindexSettings
from agentserving.proxy.cli import command as proxy_command
from agentserving.proxy.settings import ProxySettings
from agentserving.replay.fleet.process import ProcessSpec

LOOPBACK = "127.0.0.1"
IPC_PATH_MAX = 100  # a socket path is at most 107 bytes; a margin


def agentserving_argv() -> list[str]:
    """How to run the ``agentserving`` command from this interpreter's environment."""
    script = Path(sys.executable).parent / "agentserving"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from agentserving.core.cli import main; main()"]


class PortAllocator:
    """Hands out free loopback ports (and runs of consecutive ones), never the same twice,
    below the kernel's ephemeral range (``core.ports``): a vLLM pod binds its port ~10 s after
    it was picked, long enough for a client socket to take an ephemeral one."""

    def __init__(self, seed: int | None = None) -> None:
        self._taken: set[int] = set()
        self._rng = random.Random(seed)

    def one(self) -> int:
        return self.run(1)

    def run(self, n: int) -> int:
        """The first of ``n`` consecutive free ports."""
        pickable = pickable_ports()
        for _ in range(2000):
            base = self._rng.randrange(pickable.start, pickable.stop - n)
            ports = range(base, base + n)
            if any(p in self._taken for p in ports) or not all(bindable(p) for p in ports):
                continue
            self._taken.update(ports)
            return base
        raise RuntimeError(f"no run of {n} free loopback ports")


@dataclass
class FleetSpec:
    prefill: int = 1
    decode: int = 1
    both: int = 0  # workers that prefill and decode (no P/D)
    kvindex: str = "memory"  # memory | redis://...
    model: str = "tiny"
    # reference | vllm (each worker `agentserving worker --engine vllm`; with both pools, an
    # LMCache server carries the prefill -> decode hand-off)
    engine: str = "reference"
    routing: str = "kv-aware"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    hash_scheme: str | None = None  # None: the engine's own (blake3; vLLM lmcache-builtin)
    # vLLM: every worker publishes its KV events to the kvindex, which a registrar process per
    # worker keeps it registered for (plain vLLM pods; the proxy then hashes prompts the vLLM
    # way: precise prefix-cache routing)
    kv_events: bool = False
    cpu_cache_gib: float = 2.0
    disk_cache_gib: float = 0.0  # 0: no disk tier
    disk_io: str = "buffered"  # the disk tier's I/O (the worker's --disk-io): or "direct"
    # a reused prefix copied into the KV blocks layer by layer behind the forward pass (the
    # worker's --kv-layerwise-load, both engines); False: the ablation, all of it before
    kv_layerwise_load: bool = True
    # vLLM P/D: how KV reaches a decode pod. p2p: each vLLM worker has its own KV server
    # (``agentserving kvserver``) and a decode pod reads from the prefill pod's; server: one
    # central KV server every pod writes to. kv_transfer_gib bounds each server.
    kv_transfer: str = "p2p"
    kv_transfer_gib: float = 2.0
    disk_cache_root: Path | None = None  # per-worker folders under it (default: run dir)
    proxy: bool = True
    proxy_port: int = 0  # 0: a free port
    worker_args: list[str] = field(default_factory=list)
    # extra flags for one role's workers only ("prefill", "decode", "both"), after worker_args
    role_args: dict[str, list[str]] = field(default_factory=dict)
    proxy_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    worker_env: dict[str, str] = field(default_factory=dict)
    # core.internal_auth: every process gets it (the kvindex and the memory APIs require it)
    internal_token: str | None = field(default=None, repr=False)
    startup_timeout_s: float = 180.0
    # argv that replaces `agentserving worker` (tests run a stand-in with the same flags)
    worker_command: list[str] | None = None

    @property
    def num_workers(self) -> int:
        return self.prefill + self.decode + self.both


def process_env(spec: FleetSpec) -> dict[str, str]:
    """The environment every process of the fleet adds to its parent's."""
    return {**spec.env, **({TOKEN_ENV: spec.internal_token} if spec.internal_token else {})}


def kv_events_dir(run_dir: Path) -> Path:
    """Where the workers' KV event sockets go: ipc sockets, no network (vLLM binds an ipc
    endpoint, it connects to tcp hosts; the kvindex connects). The run folder, unless its path
    is too long for a socket (108 bytes); then a folder of the temp dir named after it."""
    folder = run_dir.resolve() / "kv-events"
    if len(str(folder)) + len("/decode-00.sock") <= IPC_PATH_MAX:
        return folder
    digest = hashlib.blake2b(str(folder).encode(), digest_size=6).hexdigest()
    return Path(tempfile.gettempdir()) / f"agentserving-kv-events-{digest}"


def disk_root(spec: FleetSpec, run_dir: Path) -> Path:
    """Where the workers' disk-tier folders go (one per worker below it)."""
    return spec.disk_cache_root or run_dir / "disk"


def _workers(spec: FleetSpec) -> list[tuple[str, str]]:
    """(role, name) of every worker, in start order. With decode workers, the prefill pool
    only prefills; without, it does both."""
    return ([("prefill" if spec.decode else "both", f"prefill-{k}")
             for k in range(spec.prefill)]
            + [("decode", f"decode-{k}") for k in range(spec.decode)]
            + [("both", f"worker-{k}") for k in range(spec.both)])


def _registrar(spec: FleetSpec, name: str, role: str, url: str, kv_url: str) -> ProcessSpec:
    """Keeps a plain vLLM worker registered with the kvindex (it has no connector to do it),
    under vLLM's own block hashes: its residency is its KV event stream."""
    return ProcessSpec(
        name=f"{name}-registrar", role="registrar", env=process_env(spec), startup_timeout_s=30.0,
        argv=registrar_argv({
            "kvindex": kv_url, "pod": name, "memory_api_url": url, "api_url": url, "role": role,
            "model": spec.model, "hash_scheme": HashScheme.VLLM_SHA256, "engine": "vllm",
            "chunk_size": spec.chunk_size, "residency": "vllm-events", "interval_s": 2},
            python=sys.executable))


def build(spec: FleetSpec, run_dir: Path, ports: PortAllocator | None = None
          ) -> list[ProcessSpec]:
    """Every process of the fleet, in start order: kvindex, workers, proxy."""
    ports = ports or PortAllocator()
    cmd = agentserving_argv()
    out: list[ProcessSpec] = []
    kv_port = ports.one()
    kv_url = f"http://{LOOPBACK}:{kv_port}"
    workers = _workers(spec)
    events = {name: f"ipc://{kv_events_dir(run_dir) / name}.sock"
              for _, name in workers} if spec.kv_events else {}
    out.append(ProcessSpec(
        name="kvindex", role="kvindex", url=kv_url, env=process_env(spec),
        argv=[*cmd, "kvindex", *settings_argv(kvindex_command, KvindexSettings, {
            "host": LOOPBACK, "port": kv_port, "store": spec.kvindex}),
              *(f"--vllm-events={name}={ep}" for name, ep in events.items())],
        startup_timeout_s=30.0))
    common = {"model": spec.model, "kvindex_url": kv_url, "cpu_cache_gib": spec.cpu_cache_gib,
              "chunk_size": spec.chunk_size, "engine": spec.engine,
              "hash_scheme": spec.hash_scheme or ENGINE_HASH_SCHEMES[spec.engine].value}
    handoff = spec.engine == "vllm" and spec.prefill and spec.decode
    if handoff and spec.kv_transfer == "server":
        server, values = kv_server(spec, "kvserver", ports)
        out.append(server)
        common.update(values)
    prefill_urls: list[str] = []
    decode_urls: list[str] = []
    for role, name in workers:
        port = ports.one()
        mem = ports.run(4)  # scheduler + engine processes (memory API, seed 000)
        url = f"http://{LOOPBACK}:{port}"
        values = {"role": role, "port": port, "memory_port_start": mem, "pod_name": name,
                  **common}
        if spec.disk_cache_gib > 0:
            values.update(disk_cache_dir=disk_root(spec, run_dir) / name,
                          disk_cache_gib=spec.disk_cache_gib, disk_io=spec.disk_io)
        if not spec.kv_layerwise_load:  # the workers' default is on
            values["kv_layerwise_load"] = False
        if name in events:
            values["kv_events_endpoint"] = events[name]
        if handoff and spec.kv_transfer == "p2p":  # the pod's own, started before it
            server, own = kv_server(spec, f"kvserver-{name}", ports)
            out.append(server)
            values.update(own, kv_transfer_p2p=True)
        argv = [*(spec.worker_command or [*cmd, "worker"]),
                *settings_argv(worker_command, WorkerSettings, values),
                *spec.worker_args, *spec.role_args.get(role, [])]
        env = {**process_env(spec), **spec.worker_env}
        if spec.engine == "vllm":  # vLLM binds its worker to core 0 unless told: spread them
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                           str((len(prefill_urls) + len(decode_urls)) % (os.cpu_count() or 1)))
        out.append(ProcessSpec(name=name, role=role, url=url, argv=argv, env=env,
                               startup_timeout_s=spec.startup_timeout_s,
                               memory_url=f"http://{LOOPBACK}:{mem}"))
        if name in events:
            out.append(_registrar(spec, name, role, url, kv_url))
        (decode_urls if role == "decode" else prefill_urls).append(url)
    if spec.proxy and (prefill_urls or decode_urls):
        out.append(proxy_spec(spec, spec.proxy_port or ports.one(), kv_url, prefill_urls,
                              decode_urls))
    return out


def kv_server(spec: FleetSpec, name: str, ports: PortAllocator
              ) -> tuple[ProcessSpec, dict[str, Any]]:
    """A bounded KV server (``agentserving kvserver``) and the worker settings that point a
    vLLM pod's LMCache at it."""
    lm, api = ports.one(), ports.one()
    argv = [*agentserving_argv(), "kvserver", "--host", LOOPBACK, "--port", str(lm),
            "--api-port", str(api), "--max-gib", f"{spec.kv_transfer_gib:g}"]
    url = f"http://{LOOPBACK}:{api}"
    return (ProcessSpec(name=name, role="kvserver", url=url, argv=argv, env=process_env(spec),
                        startup_timeout_s=60.0),
            {"kv_transfer_url": f"lm://{LOOPBACK}:{lm}", "kv_server_api": url})


def proxy_spec(spec: FleetSpec, port: int, kv_url: str, prefill_urls: list[str],
               decode_urls: list[str]) -> ProcessSpec:
    """The proxy of ``spec`` in front of workers already running (``build``'s, or those of a
    fleet another configuration started: ``agentserving compare`` swaps only the proxy between
    configurations that deploy the same pods)."""
    argv = [*agentserving_argv(), "proxy", *settings_argv(proxy_command, ProxySettings, {
        "host": LOOPBACK, "port": port, "kvindex_url": kv_url, "routing": spec.routing,
        "chunk_size": spec.chunk_size, "prefill_urls": prefill_urls,
        "decode_urls": decode_urls}), *spec.proxy_args]
    return ProcessSpec(name="proxy", role="proxy", url=f"http://{LOOPBACK}:{port}",
                       argv=argv, env=process_env(spec), startup_timeout_s=60.0)


def same_pods(a: FleetSpec, b: FleetSpec) -> bool:
    """Whether two fleets differ in their proxy alone (routing, proxy flags): the same
    kvindex, workers and flags, so one started fleet serves both in turn. Pods with a disk
    tier never do: what the first left in their LMCache tiers would warm the second."""
    def pods(spec: FleetSpec) -> FleetSpec:
        return replace(spec, routing="", proxy_args=[], proxy_port=0)

    return pods(a) == pods(b) and a.disk_cache_gib <= 0
