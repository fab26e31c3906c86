"""The vLLM-Ascend pods' registrar sidecar against a real kvindex process: registers with the
pod's URLs, renews, registers again after the kvindex forgot the pod, deregisters on stop,
and never touches residency (LMCache-Ascend's controller messages own it)."""

from __future__ import annotations

import asyncio

import httpx

from agentserving.core.clients import KvindexClient
from agentserving.core.schemas import ChunkSnapshot, Tier
from agentserving.engine.vllm.registrar import Registrar
from agentserving.engine.vllm.registrar_cli import parse_args

from .test_memory_api_lmcache import kvindex

ARGS = ["--pod", "ascend-agent-prefill-0", "--memory-api-url", "http://10.0.0.5:6999",
        "--api-url", "http://10.0.0.5:8000", "--role", "prefill", "--model", "glm4.7",
        "--hash-scheme", "lmcache-ascend", "--chunk-size", "256"]
H = "-6ed9a448787a198f"


def test_registrar_lifecycle(tmp_path):
    with kvindex(tmp_path) as kvi:
        reg = parse_args(["--kvindex", kvi, *ARGS]).registration()

        async def scenario() -> list[str]:
            r = Registrar(KvindexClient(kvi, timeout_s=2.0), reg, interval_s=0.05)
            steps = [await r.tick(), await r.tick()]
            # residency reported by another path (here: a snapshot standing in for the
            # controller endpoint) survives the registrar's renewals
            other = KvindexClient(kvi, timeout_s=2.0)
            await other.snapshot(reg.pod, ChunkSnapshot(seq=1, chunks={Tier.CPU: [H]}))
            steps.append(await r.tick())
            await other.deregister(reg.pod)  # the kvindex forgets the pod
            steps += [await r.tick(), await r.tick()]
            await other.aclose()
            stop = asyncio.Event()
            stop.set()
            await r.run(stop)  # stops at once: deregisters
            return steps

        def pods():
            return {p["pod"]: p for p in httpx.get(f"{kvi}/v1/pods", timeout=5).json()["pods"]}

        steps = asyncio.run(scenario())
        assert steps == ["registered", "renewed", "renewed", "unknown", "registered"]
        assert pods() == {}  # deregistered on stop
        # registration carried the pod's URLs and scheme
        assert reg.memory_api_url == "http://10.0.0.5:6999" and reg.role == "prefill"
        assert reg.hash_scheme == "lmcache-ascend" and reg.chunk_size == 256


def test_registrar_keeps_residency_it_did_not_send(tmp_path):
    with kvindex(tmp_path) as kvi:
        reg = parse_args(["--kvindex", kvi, *ARGS]).registration()

        async def scenario() -> None:
            r = Registrar(KvindexClient(kvi, timeout_s=2.0), reg)
            await r.tick()
            other = KvindexClient(kvi, timeout_s=2.0)
            await other.snapshot(reg.pod, ChunkSnapshot(seq=1, chunks={Tier.CPU: [H]}))
            await other.aclose()
            await r.tick()
            await r.tick()

        asyncio.run(scenario())
        locs = httpx.get(f"{kvi}/v1/chunks/{H}", timeout=5).json()["locations"]
        assert [(x["pod"], x["tier"]) for x in locs] == [(reg.pod, "cpu")]
        info = {p["pod"]: p for p in httpx.get(f"{kvi}/v1/pods", timeout=5).json()["pods"]}
        assert info[reg.pod]["memory_api_url"] == "http://10.0.0.5:6999"


def test_the_rendered_command_line_parses_back_to_the_same_settings():
    """The operator and the local fleet render the sidecar's command line from its settings
    (``argv``); what they render is what the sidecar parses, and a value it would refuse is
    refused while rendering, naming the field."""
    import pydantic
    import pytest

    from agentserving.engine.vllm.registrar_cli import RegistrarSettings, argv

    values = {"kvindex": "http://127.0.0.1:8300", "pod": "p-0", "memory_api_url": "http://a:1",
              "api_url": "http://a:2", "role": "decode", "model": "m",
              "hash_scheme": "vllm-sha256", "chunk_size": 16, "interval_s": 2,
              "engine": "vllm", "residency": "vllm-events"}
    line = argv(values, python="py")
    assert line[:3] == ["py", "-m", "agentserving.engine.vllm.registrar"]
    assert parse_args(line[3:]) == RegistrarSettings(**values)
    with pytest.raises(pydantic.ValidationError, match="chunk_size"):
        argv({**values, "chunk_size": 0})
