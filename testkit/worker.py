"""The worker's tests and benchmarks: deterministic prompts, driving an in-process engine core,
and running real worker processes."""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from agentserving.engine.model.tokenizer import synthetic_ids
from testkit.servers import AGENTSERVING, free_port, free_port_run, service_process

prompt = synthetic_ids  # the name every test knows


def request(req_id: str, ids: list[int], **sampling: Any) -> Any:
    from agentserving.engine.scheduler.request import EngineRequest, SamplingParams

    sp = SamplingParams(**{"max_tokens": 6, **sampling})
    return EngineRequest(req_id, list(ids), sp)


def run(parts: Any, req: Any) -> dict[str, Any]:
    """Drive an in-process engine core until ``req`` finishes."""
    core = parts.core
    core.add(req)
    outs = []
    while core.has_work():
        outs += [o for o in core.step() if o.req_id == req.req_id]
        core.run_deferred()
    first = next(o for o in outs if o.tokens)
    return {
        "tokens": [t.token_id for o in outs for t in o.tokens],
        "logprobs": [t.logprob for o in outs for t in o.tokens],
        "logits": core.captured_logits.pop(req.req_id, []),
        "first": first.meta,
        "final": outs[-1],
    }


class Worker:
    """A real ``agentserving worker`` process (API process + engine processes)."""

    def __init__(self, proc: subprocess.Popen, port: int, memory_port: int,
                 log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.memory_port = memory_port
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"
        self.memory_url = f"http://127.0.0.1:{memory_port}"

    def engine_url(self, k: int = 0) -> str:
        return f"http://127.0.0.1:{self.memory_port + 1 + k}"

    def complete(self, timeout: float = 120.0, **body: Any) -> dict[str, Any]:
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=timeout)
        assert r.status_code == 200, r.text
        return r.json()

    def stream(self, path: str, timeout: float = 120.0, **body: Any) -> list[Any]:
        events = []
        with httpx.stream("POST", self.url + path, json={**body, "stream": True},
                          timeout=timeout) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
        return events

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text


def metric_value(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in a Prometheus text page (0 if absent)."""
    needle = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(needle + " "):
            return float(line.split()[-1])
    return 0.0


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (0 if none): a
    figure over the labels a test does not name (``tier="cpu"`` over every tenant)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


@contextlib.contextmanager
def worker_process(tmp: Path, *args: str, name: str = "worker",
                   timeout_s: float = 120.0) -> Iterator[Worker]:
    """Start ``agentserving worker`` on free loopback ports; stop it (and its engines) after."""
    port, memory_port = free_port(), free_port_run(4)
    log_path = tmp / f"{name}.log"
    cmd = [AGENTSERVING, "worker", "--port", str(port),
           "--memory-port-start", str(memory_port), "--pod-name", name,
           "--torch-threads", "1", "--cpu-cache-gib", "0.25", "--log-console", *args]
    with service_process(cmd, f"http://127.0.0.1:{port}/readyz", log_path=log_path,
                         timeout_s=timeout_s) as proc:
        yield Worker(proc, port, memory_port, log_path)
