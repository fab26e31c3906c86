"""The test node's pod network: a host bridge whose traffic never leaves the machine.

Pods get addresses on their own /24 (bridge CNI, host-local IPAM) with no default route: the
only route they have besides their subnet is the Service range, via the bridge's own address.
Service traffic is routed by the host (``ip_forward``, which is why it is turned on only with
the drop rules below in place):

- ``mangle FORWARD``: anything entering the bridge from another interface, or leaving it for
  one, is dropped, so the pod subnet is never routed off the bridge;
- ``filter INPUT``: the bridge's address answers only on the bridge and on loopback;
- ``nat PREROUTING``: the cluster's two well-known addresses that have no pod behind them are
  sent to loopback (``route_localnet`` on the bridge only): the API server's Service IP to the
  real API server on 127.0.0.1, and the cluster DNS IP to the node's resolver (cluster_dns.py).

Everything lives in chains named ``AGENTSERVING-*`` hooked at the top of the built-in ones, so
``teardown`` (and ``teardown_stale`` after a killed run) removes exactly what was added.
Pure functions build the command lines; ``NodeNetwork`` runs them.
"""

from __future__ import annotations

import ipaddress
import json
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

CHAIN_PREFIX = "AGENTSERVING-"
# (table, built-in chain, our chain)
HOOKS = (("mangle", "FORWARD", "AGENTSERVING-FWD"),
         ("filter", "INPUT", "AGENTSERVING-IN"),
         ("nat", "PREROUTING", "AGENTSERVING-DNAT"))


@dataclass(frozen=True)
class NetworkPlan:
    bridge: str = "asbr0"
    pod_cidr: str = "10.244.0.0/24"
    service_cidr: str = "10.0.0.0/24"
    api_port: int = 0  # the API server's port on 127.0.0.1
    dns_port: int = 0  # the node resolver's port on 127.0.0.1

    @property
    def gateway(self) -> str:
        return str(next(ipaddress.ip_network(self.pod_cidr).hosts()))

    @property
    def api_service_ip(self) -> str:
        """The first Service IP, which the API server gives its own `kubernetes` Service."""
        return str(ipaddress.ip_network(self.service_cidr).network_address + 1)

    @property
    def dns_service_ip(self) -> str:
        return str(ipaddress.ip_network(self.service_cidr).network_address + 10)


def cni_conflist(plan: NetworkPlan, ipam_dir: Path) -> dict:
    net = ipaddress.ip_network(plan.pod_cidr)
    hosts = list(net.hosts())
    return {
        "cniVersion": "0.4.0",
        "name": "agentserving-test",
        "plugins": [{
            "type": "bridge", "bridge": plan.bridge,
            "isGateway": False, "ipMasq": False, "hairpinMode": True,
            "ipam": {
                "type": "host-local", "dataDir": str(ipam_dir),
                "ranges": [[{"subnet": plan.pod_cidr, "rangeStart": str(hosts[9]),
                             "rangeEnd": str(hosts[-1]), "gateway": plan.gateway}]],
                "routes": [{"dst": plan.service_cidr, "gw": plan.gateway}],
            },
        }],
    }


def rule_commands(plan: NetworkPlan) -> list[list[str]]:
    """iptables commands (without the binary) that fill our chains, after they are created."""
    br, gw = plan.bridge, plan.gateway
    loop = "127.0.0.1"
    return [
        ["-t", "mangle", "-A", "AGENTSERVING-FWD", "-i", br, "!", "-o", br, "-j", "DROP"],
        ["-t", "mangle", "-A", "AGENTSERVING-FWD", "-o", br, "!", "-i", br, "-j", "DROP"],
        ["-t", "filter", "-A", "AGENTSERVING-IN", "-d", gw, "-i", br, "-j", "RETURN"],
        ["-t", "filter", "-A", "AGENTSERVING-IN", "-d", gw, "-i", "lo", "-j", "RETURN"],
        ["-t", "filter", "-A", "AGENTSERVING-IN", "-d", gw, "-j", "DROP"],
        ["-t", "nat", "-A", "AGENTSERVING-DNAT", "-i", br, "-d", plan.api_service_ip,
         "-p", "tcp", "--dport", "443", "-j", "DNAT", "--to-destination",
         f"{loop}:{plan.api_port}"],
        *[["-t", "nat", "-A", "AGENTSERVING-DNAT", "-i", br, "-d", plan.dns_service_ip,
           "-p", proto, "--dport", "53", "-j", "DNAT", "--to-destination",
           f"{loop}:{plan.dns_port}"] for proto in ("udp", "tcp")],
    ]


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


class NodeNetwork:
    """Sets up and tears down the plan's bridge, iptables chains and sysctls (needs root)."""

    def __init__(self, plan: NetworkPlan, state_file: Path):
        self.plan = plan
        self.state_file = state_file

    def setup(self) -> None:
        p = self.plan
        saved = {"ip_forward": _sysctl_path("net.ipv4.ip_forward").read_text().strip(),
                 "bridge": p.bridge}
        self.state_file.write_text(json.dumps(saved))
        if _run("ip", "link", "show", p.bridge, check=False).returncode != 0:
            _run("ip", "link", "add", p.bridge, "type", "bridge")
        prefix = ipaddress.ip_network(p.pod_cidr).prefixlen
        _run("ip", "addr", "replace", f"{p.gateway}/{prefix}", "dev", p.bridge)
        _run("ip", "link", "set", p.bridge, "up")
        _sysctl_path(f"net.ipv4.conf.{p.bridge}.route_localnet").write_text("1")
        for table, builtin, chain in HOOKS:
            _run("iptables", "-t", table, "-N", chain)
            _run("iptables", "-t", table, "-I", builtin, "1", "-j", chain)
        for cmd in rule_commands(p):
            _run("iptables", *cmd)
        # Only now, with the drop rules in place: route Service traffic between pods.
        _sysctl_path("net.ipv4.ip_forward").write_text("1")

    def teardown(self) -> None:
        teardown_network(self.state_file)


def teardown_network(state_file: Path) -> None:
    """Undo ``NodeNetwork.setup`` (also after a killed run): sysctl, chains, bridge."""
    if not state_file.exists():
        return
    saved = json.loads(state_file.read_text())
    _sysctl_path("net.ipv4.ip_forward").write_text(saved.get("ip_forward", "0"))
    for table, builtin, chain in HOOKS:
        while _run("iptables", "-t", table, "-D", builtin, "-j", chain,
                   check=False).returncode == 0:
            pass
        _run("iptables", "-t", table, "-F", chain, check=False)
        _run("iptables", "-t", table, "-X", chain, check=False)
    remove_kube_chains()
    _run("ip", "link", "delete", saved["bridge"], check=False)
    state_file.unlink(missing_ok=True)


def remove_kube_chains() -> None:
    """Drop the KUBE-* chains the kubelet (KUBE-FIREWALL, KUBE-MARK-*, canaries) and kube-proxy
    leave behind even after ``kube-proxy --cleanup``: rules that jump to them first, then the
    chains. The test machine runs no other Kubernetes node whose chains these could be."""
    for table in ("filter", "nat", "mangle"):
        rules = _run("iptables", "-t", table, "-S", check=False).stdout.splitlines()
        for rule in rules:
            parts = shlex.split(rule)
            if parts[:1] == ["-A"] and not parts[1].startswith("KUBE-") and any(
                    p.startswith("KUBE-") for p in parts[2:]):
                _run("iptables", "-t", table, "-D", *parts[1:], check=False)
        chains = [r.split()[1] for r in rules if r.startswith("-N KUBE-")]
        for chain in chains:
            _run("iptables", "-t", table, "-F", chain, check=False)
        for chain in chains:
            _run("iptables", "-t", table, "-X", chain, check=False)
