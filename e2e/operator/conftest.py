"""Session fixtures for the operator e2e: a real control plane, the chart's RBAC, a fake
kvindex on loopback, and the operator as a real process authenticated as the chart's
ServiceAccount (not cluster admin).

Set AGENTSERVING_SKIP_K8S=1 to skip these tests; otherwise missing binaries fail them.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agentserving.core.schemas import PodInfo

from ..k8s.cluster import REPO, Binaries, Cluster, Fatal, free_port, wait_for

OPERATOR_NAMESPACE = "agentserving-system"
RELEASE = "agentserving"
SERVICE_ACCOUNT = "agentserving"  # the chart's default: the release's full name
CHART = REPO / "charts" / "agentserving"
HUNG_PREFIX = "hung-"  # the fake kvindex never answers in time for resources named hung-*


def pytest_collection_modifyitems(config, items):
    if os.environ.get("AGENTSERVING_SKIP_K8S") == "1":
        skip = pytest.mark.skip(reason="AGENTSERVING_SKIP_K8S=1")
        for item in items:
            if Path(str(item.fspath)).parent == Path(__file__).parent:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def binaries() -> Binaries:
    try:
        return Binaries.find()
    except FileNotFoundError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def cluster(binaries, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("k8s"), binaries)
    c.start()
    yield c
    c.stop()


def helm(binaries: Binaries, *args: str) -> str:
    proc = subprocess.run([str(binaries.helm), *args], capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
    return proc.stdout


@pytest.fixture(scope="session")
def crd(cluster):
    cluster.kubectl("apply", "-f", str(REPO / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/agentservings.agentserving.io")
    return "agentservings.agentserving.io"


@pytest.fixture(scope="session")
def chart_rbac(cluster, binaries, crd):
    """The chart's own manifests (ServiceAccount, ClusterRoles, bindings, Deployment...),
    applied for real: the operator process below runs with exactly these permissions."""
    cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE)
    rendered = helm(binaries, "template", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE)
    cluster.kubectl("apply", "-f", "-", input=rendered)
    return rendered


class FakeKvindex:
    """The kvindex REST subset the finalizer uses, under /<namespace>/<name>/ per resource,
    answering with the real schema (the finalizer reads it through core.clients)."""

    def __init__(self):
        self.deleted: list[tuple[str, str, str]] = []
        self.listed: list[tuple[str, str]] = []
        self.authorization: dict[tuple[str, str], str | None] = {}  # per resource, last sent
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                ns, name, rest = self.path.strip("/").split("/", 2)
                if rest != "v1/pods":
                    return self._reply(404, {})
                fake.listed.append((ns, name))
                if name.startswith(HUNG_PREFIX):
                    time.sleep(30)
                pods = [f"{name}-prefill-0", f"{name}-decode-0", f"{name}-decode-1",
                        f"{name}x-prefill-0", "someone-else-decode-0"]
                self._reply(200, {"pods": [PodInfo(
                    pod=p, memory_api_url=f"http://{p}:6999", model="tiny", registered_at=0,
                    last_heartbeat=0, lease_expires_at=15, seq=0, needs_resync=False,
                ).model_dump(mode="json") for p in pods]})

            def do_DELETE(self):  # noqa: N802
                ns, name, rest = self.path.strip("/").split("/", 2)
                pod = rest.removeprefix("v1/pods/")
                fake.deleted.append((ns, name, pod))
                fake.authorization[(ns, name)] = self.headers.get("Authorization")
                self._reply(200, {"removed": pod})

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="session")
def fake_kvindex():
    fake = FakeKvindex()
    yield fake
    fake.close()


class OperatorProcess:
    def __init__(self, proc: subprocess.Popen, log: Path, kubeconfig: Path, metrics: str,
                 health: str):
        self.proc, self.log, self.kubeconfig = proc, log, kubeconfig
        self.metrics_url, self.health_url = metrics, health

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            return r.read().decode()


@pytest.fixture(scope="session")
def operator(cluster, chart_rbac, fake_kvindex, tmp_path_factory):
    """`agentserving operator` as a real process, logged in with the chart's ServiceAccount."""
    workdir = tmp_path_factory.mktemp("operator")
    token = cluster.service_account_token(OPERATOR_NAMESPACE, SERVICE_ACCOUNT)
    kubeconfig = workdir / "operator.kubeconfig"
    kubeconfig.write_text(cluster.kubeconfig(token, "operator"))
    metrics_port, health_port = free_port(), free_port()
    exe = Path(sys.executable).with_name("agentserving")
    argv = [str(exe), "operator", "--metrics-host", "127.0.0.1",
            "--metrics-port", str(metrics_port), "--health-host", "127.0.0.1",
            "--health-port", str(health_port), "--cleanup-timeout", "3",
            "--kvindex-url-template", fake_kvindex.url + "/{namespace}/{name}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTSERVING_OPERATOR_")}
    # the token key as the chart's Secret gives it (internalAuth)
    env.update(KUBECONFIG=str(kubeconfig), PYTHONUNBUFFERED="1",
               AGENTSERVING_OPERATOR_TOKEN_KEY=secrets.token_urlsafe(32))
    log = workdir / "operator.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    op = OperatorProcess(proc, log, kubeconfig, f"http://127.0.0.1:{metrics_port}/metrics",
                         f"http://127.0.0.1:{health_port}/healthz")

    def healthy():
        if proc.poll() is not None:
            raise Fatal(f"operator exited {proc.returncode}:\n{op.log_text()[-3000:]}")
        with urllib.request.urlopen(op.health_url, timeout=2) as r:
            return r.status == 200
    try:
        wait_for(healthy, 60, "the operator's /healthz")
    except BaseException:
        proc.terminate()
        raise
    yield op
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
    print(f"--- operator log (tail) ---\n{op.log_text()[-4000:]}")
