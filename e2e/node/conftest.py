"""Session fixtures for the e2e on a real node: the control plane plus containerd, a kubelet and
kube-proxy (e2e/k8s/node.py), the chart installed with `helm install` (the operator runs as a
pod under its ServiceAccount), and an example applied with `kubectl apply`.

Needs root and what `make k8s images` builds. Set AGENTSERVING_SKIP_K8S=1 to skip; otherwise
missing binaries or images fail these tests.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from agentserving.core.internal_auth import auth_headers
from agentserving.operator.builders import internal_secret_name
from agentserving.operator.builders.common import KVINDEX_PORT, PROXY_PORT
from testkit.servers import free_port

from ..k8s.cluster import REPO, Binaries, Cluster, cache_dir
from ..k8s.polling import Fatal, wait_for

RELEASE = "agentserving"
OPERATOR_NAMESPACE = "agentserving-system"
CHART = REPO / "charts" / "agentserving"
EXAMPLE = REPO / "examples" / "agentserving-reference.yaml"
NAME = "tiny-agent"  # the example's metadata.name
NAMESPACE = "default"
INSTANCE_LABEL = f"app.kubernetes.io/instance={NAME}"


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    reason = ("AGENTSERVING_SKIP_K8S=1" if os.environ.get("AGENTSERVING_SKIP_K8S") == "1"
              else "the test node needs root (bridge, iptables, mounts)" if os.geteuid() != 0
              else None)
    if reason:
        for item in items:
            if Path(str(item.fspath)).parent == here:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def node_cluster(tmp_path_factory) -> Iterator[Cluster]:
    try:
        binaries = Binaries.find(node=True)
    except FileNotFoundError as e:
        pytest.fail(str(e))
    if not (cache_dir() / "images" / "worker.tar").exists():
        pytest.fail(f"no images in {cache_dir() / 'images'}: run `make images`")
    cluster = Cluster(tmp_path_factory.mktemp("k8s-node"), binaries, node=True)
    cluster.start(timeout=180)
    try:
        yield cluster
    finally:
        cluster.stop()


def helm(cluster: Cluster, *args: str, timeout: float = 300) -> str:
    proc = subprocess.run([str(cluster.bin.helm), f"--kubeconfig={cluster.admin_kubeconfig}",
                           *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
    return proc.stdout


@pytest.fixture(scope="session")
def release(node_cluster):
    """`helm install` of the chart, as the README tells a user; the operator pod Ready."""
    helm(node_cluster, "install", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE,
         "--create-namespace", "--wait", "--timeout", "180s")
    return RELEASE


def pods(cluster: Cluster, selector: str = INSTANCE_LABEL, namespace: str = NAMESPACE) -> list:
    return cluster.get_json("pods", "-n", namespace, "-l", selector)["items"]


def is_ready(pod: dict) -> bool:
    return pod["status"].get("phase") == "Running" and not pod["metadata"].get(
        "deletionTimestamp") and any(c["type"] == "Ready" and c["status"] == "True"
                                     for c in pod["status"].get("conditions", []))


def component_of(pod: dict) -> str:
    return pod["metadata"]["labels"].get("app.kubernetes.io/component", "")


def describe_failure(cluster: Cluster, selector: str = INSTANCE_LABEL) -> str:
    """What a failed wait shows: each pod's phase and the last lines of its log."""
    out = []
    for pod in pods(cluster, selector):
        name = pod["metadata"]["name"]
        logs = cluster.kubectl("logs", "-n", NAMESPACE, name, "--tail=15", check=False)
        out.append(f"{name}: {pod['status'].get('phase')} ready={is_ready(pod)}\n"
                   f"{logs.stdout or logs.stderr}")
    return "\n".join(out)


def wait_ready(cluster: Cluster, expected: dict[str, int], timeout: float = 300,
               name: str = NAME) -> list:
    """Wait until exactly ``expected`` ready pods per component of resource ``name`` (and
    none terminating)."""
    selector = f"app.kubernetes.io/instance={name}"

    def settled():
        current = pods(cluster, selector)
        counts: dict[str, int] = {}
        for pod in current:
            restarts = max((c.get("restartCount", 0) for c in pod["status"].get(
                "containerStatuses", [])), default=0)
            if restarts >= 3:  # a crash loop will not settle: fail now, with the logs
                raise Fatal(f"{pod['metadata']['name']} restarted {restarts} times\n"
                            f"{describe_failure(cluster, selector)}")
            if not is_ready(pod):
                return None
            counts[component_of(pod)] = counts.get(component_of(pod), 0) + 1
        return current if counts == expected else None
    try:
        return wait_for(settled, timeout, f"ready pods {expected}", interval=1)
    except TimeoutError as e:
        raise TimeoutError(f"{e}\n{describe_failure(cluster, selector)}") from None


def apply_example(cluster: Cluster, example: Path, timeout: float = 300,
                  extra: dict[str, int] | None = None) -> list:
    """`kubectl apply -f EXAMPLE`, then wait for its pods (one per replica of each component,
    plus ``extra``) Running and Ready."""
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", str(example))
    resource = json.loads(cluster.kubectl(
        "create", "--dry-run=client", "-o", "json", "-f", str(example)).stdout)
    spec = resource["spec"]
    expected = {c: spec[c]["replicas"] for c in ("kvindex", "proxy", "prefill", "decode")}
    return wait_ready(cluster, {**expected, **(extra or {})}, timeout,
                      name=resource["metadata"]["name"])


@pytest.fixture(scope="session")
def reference(node_cluster, release):
    """`kubectl apply -f examples/agentserving-reference.yaml`: every pod Running and Ready."""
    yield apply_example(node_cluster, EXAMPLE)


class PortForward:
    """`kubectl port-forward --address 127.0.0.1 svc/NAME LOCAL:PORT` while in the block."""

    def __init__(self, cluster: Cluster, target: str, port: int, log: Path):
        self.cluster, self.target, self.port = cluster, target, port
        self.local = free_port()
        self.log = log
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> PortForward:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [str(self.cluster.bin.kubectl), f"--kubeconfig={self.cluster.admin_kubeconfig}",
                 "port-forward", "--address", "127.0.0.1", "-n", NAMESPACE, self.target,
                 f"{self.local}:{self.port}"], stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL)

        def listening():
            if self.proc.poll() is not None:
                raise Fatal(f"port-forward exited:\n{self.log.read_text()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.local), 0.5):
                return True
            return False
        wait_for(listening, 30, f"port-forward to {self.target}")
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.local}"

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def proxy_url(node_cluster, reference, tmp_path_factory) -> Iterator[str]:
    with PortForward(node_cluster, f"svc/{NAME}-proxy", PROXY_PORT,
                     tmp_path_factory.mktemp("pf") / "proxy.log") as pf:
        yield pf.url


@pytest.fixture(scope="session")
def kvindex_url(node_cluster, reference, tmp_path_factory) -> Iterator[str]:
    with PortForward(node_cluster, f"svc/{NAME}-kvindex", KVINDEX_PORT,
                     tmp_path_factory.mktemp("pf") / "kvindex.log") as pf:
        yield pf.url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def internal_token(node_cluster, reference) -> str:
    """The components' token, from the Secret the operator made for the resource."""
    secret = node_cluster.get_json("secret", internal_secret_name(NAME), "-n", NAMESPACE)
    return base64.b64decode(secret["data"]["token"]).decode()


def registered_pods(kvindex_url: str, token: str) -> set[str]:
    return {p["pod"] for p in httpx.get(kvindex_url + "/v1/pods", headers=auth_headers(token),
                                        timeout=5).json()["pods"]}


def retry_get(url: str, attempts: int = 20) -> httpx.Response:
    for _ in range(attempts):
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url, timeout=5)
        time.sleep(0.5)
    return httpx.get(url, timeout=5)


TURN_TOKENS = 300


def prompt_for(seed: int, n: int) -> list[int]:
    return [3 + (seed * 131 + i * 7) % 250 for i in range(n)]


def turn(c: openai.OpenAI, session: str, prompt: list[int], max_tokens: int = 4):
    raw = c.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_headers={"x-session-id": session})
    return raw.parse(), raw.headers


def chunk_hashes_of(resp) -> list[str]:  # noqa: ANN001
    return (resp.model_extra or {})["kv_transfer_params"]["chunk_hashes"]


class Session:
    """A multi-turn session: each turn appends a new message to the whole context."""

    def __init__(self, c: openai.OpenAI, sid: str, seed: int, first: int = 600):
        self.c, self.sid, self.seed = c, sid, seed
        self.prompt = prompt_for(seed, first)
        self.turns = 0

    def next(self):  # noqa: ANN201
        resp, headers = turn(self.c, self.sid, self.prompt)
        self.turns += 1
        self.prompt = self.prompt + prompt_for(self.seed * 10 + self.turns, TURN_TOKENS)
        return resp, headers


def three_turns(c: openai.OpenAI, sid: str, seed: int) -> list:
    """A 3-turn session's (response, headers), checked as every deployment must answer it:
    one chunk_hash per full chunk, KV reused from turn 2 on and more on turn 3, the hash chain
    extended with its prefix unchanged."""
    session = Session(c, sid, seed)
    turns = [session.next() for _ in range(3)]
    cached = [resp.usage.prompt_tokens_details.cached_tokens for resp, _ in turns]
    hashes = [chunk_hashes_of(resp) for resp, _ in turns]
    for (resp, _), chain in zip(turns, hashes, strict=True):
        assert len(chain) == resp.usage.prompt_tokens // 256
    assert cached[1] >= 512 and cached[2] > cached[1], cached
    assert hashes[1][: len(hashes[0])] == hashes[0]  # the chain extends, prefix unchanged
    return turns
