"""API fuzzing from each service's own OpenAPI, with schemathesis and every one of its checks.

``fuzz(url, ...)`` runs ``schemathesis run URL/openapi.json --checks all`` against a real
server on loopback (a real process, real HTTP), bounded by ``--max-examples`` per operation
and a fixed ``--seed`` (CI reproducible, no example database), then reads its JSON and NDJSON
reports back. ``FuzzRun.assert_clean()`` states what every service must show:

- schemathesis found nothing: no 5xx (not_a_server_error), every status documented, the
  content types and bodies as the schema says, schema-valid requests accepted, schema-invalid
  ones rejected, a 405 with a true ``Allow``, stateful links that hold (use after free, ...);
- and beyond its checks: every 4xx is OpenAI's error shape, and every 400 names its field.

The figures of each run (operations, test cases, requests, checks, statuses) are printed and,
when ``AGENTSERVING_FUZZ_REPORT`` names a file, written there as JSON.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import re
import subprocess
import sys
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from testkit.servers import AGENTSERVING, free_port, service_process
from testkit.worker import Worker, worker_process

HERE = Path(__file__).parent
SCHEMATHESIS = str(Path(sys.executable).parent / "schemathesis")
SEED = 19  # any fixed seed keeps CI reproducible
_FIGURES: dict[str, dict[str, Any]] = {}


@dataclass
class FuzzRun:
    label: str
    returncode: int
    output: str
    report: dict[str, Any]
    statuses: collections.Counter = field(default_factory=collections.Counter)
    checks_run: int = 0
    check_names: set[str] = field(default_factory=set)
    requests: int = 0
    bad_errors: list[str] = field(default_factory=list)
    sent: list[tuple[str, str, Any]] = field(default_factory=list)  # method, path, JSON body

    def strings_sent(self) -> set[str]:
        """Every string in every JSON body the fuzzer sent, and every path segment."""
        out: set[str] = set()

        def walk(node: Any) -> None:
            if isinstance(node, str):
                out.add(node)
            elif isinstance(node, dict):
                for k, v in node.items():
                    walk(k)
                    walk(v)
            elif isinstance(node, list):
                for v in node:
                    walk(v)

        for _, path, body in self.sent:
            out.update(urllib.parse.unquote(seg) for seg in path.split("/"))
            walk(body)
        return out

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    def figures(self) -> dict[str, Any]:
        return {
            "operations": self.report["operations"]["tested"],
            "test_cases": self.report["test_cases"]["generated"],
            "requests": self.requests,
            "checks_run": self.checks_run,
            "checks": sorted(self.check_names),
            "failures": len(self.report["failures"]),
            "errors": len(self.report["errors"]),
            "responses_5xx": self.server_errors,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "seconds": round(self.report["running_time"], 2),
            "seed": self.report["seed"],
        }

    def assert_clean(self) -> None:
        assert self.report["operations"]["tested"] == self.report["operations"]["total"], (
            f"{self.label}: not every operation was tested:\n{self.output[-4000:]}")
        assert self.returncode == 0 and not self.report["failures"] and not self.report[
            "errors"], f"{self.label}: schemathesis found failures:\n{self.output[-12000:]}"
        assert self.server_errors == 0, f"{self.label}: 5xx answers: {self.statuses}"
        assert not self.bad_errors, (
            f"{self.label}: error answers that do not name the field:\n"
            + "\n".join(self.bad_errors[:10]))
        assert self.requests > 0 and self.checks_run > 0


# Anthropic's errors carry no param: a 400's message starts with the field it names
_NAMED_FIELD = re.compile(r"^[A-Za-z_][\w.\[\]-]*: ")


def _error_problem(status: int, content: bytes) -> str | None:
    """None when a 4xx body is OpenAI's error shape, or Anthropic's on its routes (and a 400
    names its field)."""
    try:
        body = json.loads(content)
        err = body["error"]
        message = err["message"]
        param = err.get("param") if body.get("type") == "error" else err["param"]
        if body.get("type") == "error" and isinstance(message, str):
            param = param or (message.split(":")[0] if _NAMED_FIELD.match(message) else None)
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{status}: not an error body: {content[:200]!r}"
    if not isinstance(message, str) or not message:
        return f"{status}: no message: {content[:200]!r}"
    if status == 400 and not param:
        return f"400 without param: {content[:300]!r}"
    return None


def _read_ndjson(path: Path, run: FuzzRun) -> None:
    for line in path.read_text().splitlines():
        event = json.loads(line)
        finished = event.get("ScenarioFinished")
        if not finished:
            continue
        recorder = finished["recorder"]
        for checks in recorder.get("checks", {}).values():
            run.checks_run += len(checks)
            run.check_names.update(c["name"] for c in checks)
        for interaction in recorder.get("interactions", {}).values():
            response = interaction.get("response")
            if response is None:
                continue
            run.requests += 1
            req = interaction["request"]
            raw_body = req.get("body") or {}
            try:
                body = json.loads(base64.b64decode(raw_body["$base64"]) if "$base64" in raw_body
                                  else raw_body.get("string", "null"))
            except (ValueError, UnicodeDecodeError):
                body = None
            run.sent.append((req["method"], urllib.parse.urlsplit(req["uri"]).path, body))
            status = response["status_code"]
            run.statuses[status] += 1
            if 400 <= status < 500 and interaction["request"]["method"] != "HEAD":
                raw = response.get("content") or {}
                content = (base64.b64decode(raw["$base64"]) if "$base64" in raw
                           else str(raw.get("string", "")).encode())
                problem = _error_problem(status, content)
                if problem:
                    req = interaction["request"]
                    run.bad_errors.append(f"{req['method']} {req['uri']}: {problem}")


@pytest.fixture(scope="session")
def fuzz_figures() -> dict[str, dict[str, Any]]:
    yield _FIGURES
    target = os.environ.get("AGENTSERVING_FUZZ_REPORT")
    if target and _FIGURES:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(json.dumps({"bench": "api_fuzz", "tool": "schemathesis",
                                            "targets": _FIGURES}, indent=2) + "\n")


@pytest.fixture
def fuzz(tmp_path: Path, fuzz_figures: dict[str, dict[str, Any]]):  # type: ignore[no-untyped-def]
    def run(base_url: str, label: str, *, max_examples: int, extra: tuple[str, ...] = (),
            runtime_limit_codes: tuple[str, ...] | None = None,
            timeout_s: float = 120.0) -> FuzzRun:
        """``runtime_limit_codes``: run st_hooks' check in place of positive_data_acceptance,
        allowing a 400 with one of these error codes (limits of the model behind the API)."""
        out = tmp_path / label.replace(" ", "-")
        out.mkdir()
        cmd = [SCHEMATHESIS, "run", f"{base_url}/openapi.json", "--checks", "all",
               "--seed", str(SEED), "--max-examples", str(max_examples), "-w", "1",
               "--generation-database", "none", "--no-color", "--output-sanitize", "false",
               "--request-timeout", "30", "--report", "json,ndjson",
               "--report-json-path", str(out / "report.json"),
               "--report-ndjson-path", str(out / "events.ndjson"), *extra]
        env = dict(os.environ)
        if runtime_limit_codes is not None:
            cmd += ["--exclude-checks", "positive_data_acceptance"]
            env.update(SCHEMATHESIS_HOOKS="st_hooks",
                       FUZZ_RUNTIME_LIMIT_CODES=",".join(runtime_limit_codes),
                       PYTHONPATH=os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]))
        proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
        output = proc.stdout + proc.stderr
        if not (out / "report.json").exists():
            raise AssertionError(f"{label}: schemathesis wrote no report:\n{output[-6000:]}")
        result = FuzzRun(label, proc.returncode, output,
                         json.loads((out / "report.json").read_text()))
        _read_ndjson(out / "events.ndjson", result)
        fuzz_figures[label] = result.figures()
        print(f"\n[fuzz] {label}: {json.dumps(result.figures())}")
        return result

    return run


MAX_MODEL_LEN = 32  # bounds what one schema-valid completion may cost on 2 cores


@dataclass
class Fleet:
    kvindex_url: str
    worker: Worker
    proxy_url: str


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A real kvindex (memory), one tiny reference worker registered with it, and a proxy
    that finds the worker through the kvindex: all real processes on loopback."""
    tmp = tmp_path_factory.mktemp("fuzz-fleet")
    kv_port, proxy_port = free_port(), free_port()
    kv_url, proxy_url = f"http://127.0.0.1:{kv_port}", f"http://127.0.0.1:{proxy_port}"
    with service_process([AGENTSERVING, "kvindex", "--port", str(kv_port), "--store", "memory",
                          "--lease-ttl", "3600", "--log-level", "warning"], kv_url + "/readyz",
                         log_path=tmp / "kvindex.log") as kv_proc, \
            worker_process(tmp, "--model", "tiny", "--max-model-len", str(MAX_MODEL_LEN),
                           "--chunk-size", "64", "--disk-cache-dir", str(tmp / "disk"),
                           "--disk-cache-gib", "0.25", "--kvindex", kv_url,
                           "--heartbeat-interval", "0.5", name="fuzz-worker") as worker, \
            service_process([AGENTSERVING, "proxy", "--port", str(proxy_port), "--kvindex",
                             kv_url, "--chunk-size", "64", "--discovery-interval", "0.3",
                             "--log-level", "warning"], proxy_url + "/readyz",
                            log_path=tmp / "proxy.log") as proxy_proc:
        yield Fleet(kv_url, worker, proxy_url)
        for name, proc in (("kvindex", kv_proc), ("worker", worker.proc), ("proxy", proxy_proc)):
            assert proc.poll() is None, f"the {name} died during the fuzz runs"
