"""One real Kubernetes node beside the test control plane: containerd + runc, a kubelet,
kube-proxy, the pod network (node_network.py) and the cluster DNS (cluster_dns.py).

Pods run for real from the images ``scripts/images.sh`` built (imported into this node's
containerd at start; the vLLM image, which only a later test's pods run, in the background:
``wait_images`` before using it). Everything the node starts or changes is written to a state
file under the cache folder first, so ``teardown`` undoes it after a failed test, Ctrl-C, or,
on the next start, a run that was killed outright (``teardown_stale``). Pods live in
``/kubepods`` cgroups outside the test's own process tree: their processes are killed through
those cgroups, not through the kubelet, so teardown does not depend on the kubelet or
containerd still working.
Needs root (bridge, iptables, mounts).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from testkit.servers import free_port

from .cluster_dns import ClusterDNS
from .node_network import NetworkPlan, NodeNetwork, cni_conflist, teardown_network
from .polling import Fatal, wait_for

NODE_NAME = "localhost"  # the API server dials the kubelet by this name (127.0.0.1)
PAUSE_IMAGE = "docker.io/agentserving/pause:3.9"
CGROUP_ROOT = Path("/sys/fs/cgroup")
# Paths the kubelet and containerd write outside their own folders.
FIXED_PATHS = ("/var/log/pods", "/var/log/containers", "/var/lib/kubelet", "/run/containerd")
# Imported while the node starts and the first tests run (no pod of theirs needs them): the
# vLLM image alone takes a minute and a half to import on 2 cores.
BACKGROUND_IMAGES = ("vllm-cpu",)


def containerd_config(root: Path, state: Path, socket: Path, cni_conf: Path) -> str:
    return f"""version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{socket}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni_conf}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
"""


def kubelet_config(port: int, healthz_port: int, dns_ip: str, resolv_conf: Path) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": "127.0.0.1", "port": port, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": healthz_port,
        "cgroupDriver": "cgroupfs", "failSwapOn": False,
        # The API server reaches logs/exec/port-forward without a client certificate.
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDNS": [dns_ip], "clusterDomain": "cluster.local",
        "resolvConf": str(resolv_conf),
        # A shared test machine's disk and memory are not this node's to evict for.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "enableControllerAttachDetach": False,
        "serializeImagePulls": False,
        "maxPods": 30,
    }


def _cgroup_dirs() -> list[Path]:
    """Every /kubepods cgroup, deepest first (cgroup v1: one tree per controller)."""
    dirs = [d for top in CGROUP_ROOT.glob("*/kubepods") for d in top.rglob("*") if d.is_dir()]
    dirs += list(CGROUP_ROOT.glob("*/kubepods"))
    return sorted(dirs, key=lambda d: len(d.parts), reverse=True)


def kill_pod_processes() -> int:
    """SIGKILL every process in a /kubepods cgroup; returns how many were signalled."""
    pids: set[int] = set()
    for d in _cgroup_dirs():
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in (d / "cgroup.procs").read_text().split())
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def _kill_matching(needle: str) -> None:
    for proc_dir in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if needle in (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                os.kill(int(proc_dir.name), signal.SIGKILL)


def _unmount_under(prefixes: list[str]) -> None:
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for target in sorted(mounts, key=len, reverse=True):
        if any(target == p or target.startswith(p.rstrip("/") + "/") for p in prefixes):
            subprocess.run(["umount", "-l", target], capture_output=True)


def _stop(pid: int, timeout: float = 15) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)


def teardown_stale(state_file: Path, kube_proxy: Path | None = None) -> None:
    """Undo everything a node recorded in ``state_file`` (this run's, or a killed run's)."""
    if not state_file.exists():
        return
    state = json.loads(state_file.read_text())
    pids = state.get("pids", {})
    if "kubelet" in pids:
        _stop(pids["kubelet"])
    for _ in range(3):  # containers restart under a live kubelet; it is gone now
        if kill_pod_processes() == 0:
            break
        time.sleep(0.5)
    if state.get("containerd_socket"):
        _kill_matching(f"-address {state['containerd_socket']}")  # the shims
    for name in ("containerd", "kube-proxy"):
        if name in pids:
            _stop(pids[name])
    proxy = kube_proxy or (Path(state["kube_proxy"]) if state.get("kube_proxy") else None)
    if proxy and proxy.exists():
        subprocess.run([str(proxy), "--cleanup"], capture_output=True, timeout=60)
    workdir = state.get("workdir", "")
    _unmount_under([p for p in (workdir, "/run/containerd", "/run/netns") if p])
    if workdir:  # unpacked images: gigabytes per run, which pytest's kept basetemps would keep
        shutil.rmtree(Path(workdir) / "containerd", ignore_errors=True)
    for netns in Path("/run/netns").glob("cni-*"):
        netns.unlink(missing_ok=True)
    for d in _cgroup_dirs():
        with contextlib.suppress(OSError):
            d.rmdir()
    for path in state.get("created_paths", []):
        shutil.rmtree(path, ignore_errors=True)
    teardown_network(Path(state["network_state"]))
    state_file.unlink()


class Node:
    """``start()`` after the control plane is up; ``stop()`` always (it is idempotent)."""

    def __init__(self, cluster, state_file: Path, images: Path | None = None):
        self.cluster = cluster
        self.bin = cluster.bin
        self.dir = cluster.dir / "node"
        self.state_file = state_file
        self.images = images
        self.socket = self.dir / "containerd" / "containerd.sock"
        self.plan = NetworkPlan(api_port=cluster.api_port, dns_port=free_port())
        self.kubelet_port, self.kubelet_healthz = free_port(), free_port()
        self.proxy_healthz, self.proxy_metrics = free_port(), free_port()
        self.procs: dict[str, subprocess.Popen] = {}
        self.dns: ClusterDNS | None = None
        self.state: dict = {}
        self._imports: threading.Thread | None = None
        self._import_error: BaseException | None = None

    # -- state -------------------------------------------------------------------------------
    def _record(self, **changes) -> None:
        self.state.update(changes)
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(self.state, indent=2))

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self._record(pids={**self.state.get("pids", {}), name: self.procs[name].pid})

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) \
            if path.exists() else ""

    # -- start -------------------------------------------------------------------------------
    def start(self, timeout: float = 120) -> None:
        teardown_stale(self.state_file, self.bin.kube_proxy)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._record(workdir=str(self.dir), containerd_socket=str(self.socket),
                     kube_proxy=str(self.bin.kube_proxy),
                     network_state=str(self.dir / "network.json"),
                     created_paths=[p for p in FIXED_PATHS if not Path(p).exists()])
        try:
            NodeNetwork(self.plan, self.dir / "network.json").setup()
            self.dns = ClusterDNS(self.plan.dns_port, self._service_ips)
            self._reserve_dns_ip()
            self._start_containerd(timeout)
            self._load_images()
            self._start_kube_proxy()
            self._start_kubelet(timeout)
        except BaseException:
            self.stop()
            raise

    def _service_ips(self, namespace: str, name: str) -> list[str]:
        svc = self.cluster.api_get(f"/api/v1/namespaces/{namespace}/services/{name}")
        ip = svc["spec"].get("clusterIP")
        if ip and ip != "None":
            return [ip]
        eps = self.cluster.api_get(f"/api/v1/namespaces/{namespace}/endpoints/{name}")
        return [a["ip"] for s in eps.get("subsets", []) for a in s.get("addresses", [])]

    def _reserve_dns_ip(self) -> None:
        """A selector-less Service holds the DNS IP so no other Service is given it."""
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": "kube-system"},
            "spec": {"clusterIP": self.plan.dns_service_ip,
                     "ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]}}))

    def _start_containerd(self, timeout: float) -> None:
        cni = self.dir / "cni"
        cni.mkdir(exist_ok=True)
        (cni / "10-agentserving.conflist").write_text(
            json.dumps(cni_conflist(self.plan, self.dir / "cni-ipam"), indent=2))
        config = self.dir / "containerd.toml"
        config.write_text(containerd_config(self.dir / "containerd" / "root",
                                            self.dir / "containerd" / "state", self.socket, cni))
        self._spawn("containerd", [str(self.bin.containerd), "--config", str(config)])

        def up():
            self._check_alive("containerd")
            return self.ctr("version", check=False).returncode == 0
        wait_for(up, timeout, "containerd")

    def ctr(self, *args: str, check: bool = True, timeout: float = 600):
        proc = subprocess.run([str(self.bin.ctr), "--address", str(self.socket), "-n", "k8s.io",
                               *args], capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)}: {proc.stderr.strip()}")
        return proc

    def _load_images(self) -> None:
        archives = sorted(self.images.glob("*.tar")) if self.images else []
        if not any(a.stem == "pause" for a in archives):
            raise FileNotFoundError(f"no pause image in {self.images}: run `make images`")
        for archive in archives:
            if archive.stem not in BACKGROUND_IMAGES:
                self.ctr("images", "import", str(archive))
        later = [a for a in archives if a.stem in BACKGROUND_IMAGES]
        self._imports = threading.Thread(target=self._import, args=(later,), daemon=True,
                                         name="node-image-import")
        self._imports.start()

    def _import(self, archives: list[Path]) -> None:
        try:
            for archive in archives:
                self.ctr("images", "import", str(archive))
        except BaseException as e:  # noqa: BLE001 - handed to wait_images
            self._import_error = e

    def wait_images(self, timeout: float = 600) -> None:
        """Wait for the images imported in the background; raise what their import raised."""
        if self._imports is not None:
            self._imports.join(timeout)
            if self._imports.is_alive():
                raise TimeoutError(f"the background image import took over {timeout:.0f} s")
        if self._import_error is not None:
            raise RuntimeError(f"importing {BACKGROUND_IMAGES}: {self._import_error}")

    def _start_kube_proxy(self) -> None:
        self._spawn("kube-proxy", [
            str(self.bin.kube_proxy), f"--kubeconfig={self.cluster.admin_kubeconfig}",
            "--proxy-mode=iptables", f"--cluster-cidr={self.plan.pod_cidr}",
            f"--hostname-override={NODE_NAME}", "--bind-address=127.0.0.1",
            f"--healthz-bind-address=127.0.0.1:{self.proxy_healthz}",
            f"--metrics-bind-address=127.0.0.1:{self.proxy_metrics}",
            # No sysctl or NodePort changes outside the bridge: no conntrack tuning, NodePorts
            # only on the pod subnet (so route_localnet stays off everywhere but the bridge).
            "--conntrack-max-per-core=0", f"--nodeport-addresses={self.plan.pod_cidr}",
        ])

    def _start_kubelet(self, timeout: float) -> None:
        resolv = self.dir / "resolv.conf"
        resolv.write_text(f"nameserver {self.plan.dns_service_ip}\n")
        config = self.dir / "kubelet.json"
        config.write_text(json.dumps(kubelet_config(
            self.kubelet_port, self.kubelet_healthz, self.plan.dns_service_ip, resolv)))
        kubeconfig = self.dir / "kubelet.kubeconfig"
        kubeconfig.write_text(self.cluster.kubeconfig(self.cluster.node_token,
                                                      f"system:node:{NODE_NAME}"))
        self._spawn("kubelet", [
            str(self.bin.kubelet), f"--kubeconfig={kubeconfig}", f"--config={config}",
            "--container-runtime=remote",
            f"--container-runtime-endpoint=unix://{self.socket}",
            f"--pod-infra-container-image={PAUSE_IMAGE}",
            f"--hostname-override={NODE_NAME}", f"--root-dir={self.dir / 'kubelet'}",
            f"--cert-dir={self.dir / 'kubelet-pki'}", "--v=1",
        ])

        def ready():
            self._check_alive("kubelet")
            node = self.cluster.api_get(f"/api/v1/nodes/{NODE_NAME}")
            conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
            taints = [t["key"] for t in node["spec"].get("taints", [])]
            return conditions.get("Ready") == "True" and not taints
        wait_for(ready, timeout, f"node {NODE_NAME} Ready and untainted")

    def _check_alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise Fatal(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    # -- stop --------------------------------------------------------------------------------
    def stop(self) -> None:
        if self.dns:
            self.dns.stop()
            self.dns = None
        if self._imports is not None:  # let an import under way finish before containerd goes
            self._imports.join(300)
        for proc in self.procs.values():
            with contextlib.suppress(Exception):
                proc.poll()
        teardown_stale(self.state_file, self.bin.kube_proxy)
        self.procs.clear()


def main() -> None:
    """`scripts/k8s-test-cluster.sh down`: undo what a killed node left behind."""
    from .cluster import cache_dir
    state = cache_dir() / "node" / "state.json"
    if not state.exists():
        print(f"nothing to tear down ({state} absent)")
        return
    teardown_stale(state)
    print("torn down: pods, containerd, kube-proxy rules, the bridge, /kubepods cgroups")


if __name__ == "__main__":
    main()
