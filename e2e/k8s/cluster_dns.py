"""The test node's cluster DNS: ``<service>.<namespace>.svc.<domain>`` -> the Service's IPs.

Pods resolve Service names as on any cluster (the kubelet writes the cluster DNS IP and the
search path into their resolv.conf); node_network.py sends that IP's port 53 to this resolver
on 127.0.0.1. It answers A queries from the API server (a ClusterIP, or the ready endpoint
addresses of a headless Service) and NXDOMAIN for anything else: the pod network has no way
out, so there is nothing upstream to ask. A stand-in for CoreDNS, which has no Debian package
and cannot be pulled here; the answers are the same for the names the project uses.
"""

from __future__ import annotations

import socketserver
import struct
import threading
import time
from collections.abc import Callable

import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

Lookup = Callable[[str, str], list[str]]  # (namespace, service) -> IPv4 addresses
TTL_S = 5


def service_of(qname: str, domain: str) -> tuple[str, str] | None:
    """(namespace, service) for ``<service>.<namespace>.svc.<domain>.``, else None."""
    labels = qname.lower().rstrip(".").split(".")
    suffix = ["svc", *domain.lower().split(".")]
    if len(labels) != 2 + len(suffix) or labels[2:] != suffix:
        return None
    return labels[1], labels[0]


def answer(query: bytes, domain: str, lookup: Lookup) -> bytes:
    request = dns.message.from_wire(query)
    response = dns.message.make_response(request)
    response.flags |= dns.flags.AA
    question = request.question[0]
    target = service_of(question.name.to_text(), domain)
    addresses = lookup(*target) if target else []
    if not addresses:
        response.set_rcode(dns.rcode.NXDOMAIN)
    elif question.rdtype == dns.rdatatype.A:
        response.answer.append(dns.rrset.from_text_list(
            question.name, TTL_S, dns.rdataclass.IN, dns.rdatatype.A, addresses))
    return response.to_wire()


class CachedLookup:
    """Memoises ``lookup`` for a second: a pod start resolves the same few names many times."""

    def __init__(self, lookup: Lookup, ttl_s: float = 1.0):
        self._lookup, self._ttl = lookup, ttl_s
        self._cache: dict[tuple[str, str], tuple[float, list[str]]] = {}
        self._lock = threading.Lock()

    def __call__(self, namespace: str, service: str) -> list[str]:
        key, now = (namespace, service), time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
        if hit and now - hit[0] < self._ttl:
            return hit[1]
        try:
            value = self._lookup(namespace, service)
        except Exception:  # noqa: BLE001 - an unreachable API answers like an unknown name
            value = []
        with self._lock:
            self._cache[key] = (now, value)
        return value


class ClusterDNS:
    """UDP and TCP on 127.0.0.1:``port``, each in a daemon thread; ``stop()`` closes both."""

    def __init__(self, port: int, lookup: Lookup, domain: str = "cluster.local"):
        cached = CachedLookup(lookup)
        respond = lambda data: answer(data, domain, cached)  # noqa: E731

        class Udp(socketserver.BaseRequestHandler):
            def handle(self):
                data, sock = self.request
                sock.sendto(respond(data), self.client_address)

        class Tcp(socketserver.StreamRequestHandler):
            def handle(self):
                (length,) = struct.unpack("!H", self.rfile.read(2))
                reply = respond(self.rfile.read(length))
                self.wfile.write(struct.pack("!H", len(reply)) + reply)

        self.servers = [socketserver.ThreadingUDPServer(("127.0.0.1", port), Udp),
                        socketserver.ThreadingTCPServer(("127.0.0.1", port), Tcp)]
        for server in self.servers:
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, daemon=True,
                             name=f"cluster-dns-{type(server).__name__}").start()

    def stop(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()
