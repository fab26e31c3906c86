"""Fuzz the KV server (``agentserving kvserver``, a real process) from its own OpenAPI, with
chunks in it that LMCache's protocol put there.

``/v1/pull`` is left out: a schema-valid pull names any http(s) URL as its source, and tests
reach nothing beyond loopback (the pull's answers are tested in engine/kvserver/tests). After
the run the server is alive on both ports, within its bound, and lists only chunk hashes.
"""

from __future__ import annotations

import httpx
import torch
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage

from agentserving.core.hashing import is_chunk_hash
from testkit.kvserver import LmClient, raw_connection, recv_exactly
from testkit.servers import AGENTSERVING, free_port, service_process


def _lm(port: int, command: ClientCommand, chunk_hash: int, payload: bytes = b"") -> bytes:
    with raw_connection(port) as sock:
        sock.sendall(ClientMetaMessage(command, LmClient.key(chunk_hash), len(payload),
                                       MemoryFormat(1), torch.uint8,
                                       torch.Size([len(payload), 0, 0, 0])).serialize()
                     + payload)
        sock.sendall(ClientMetaMessage(ClientCommand.HEALTH, LmClient.key(0), 0,
                                       MemoryFormat(1), torch.uint8,
                                       torch.Size([0, 0, 0, 0])).serialize())
        return recv_exactly(sock, ServerMetaMessage.packlength())


def test_kvserver_api_fuzz(fuzz, tmp_path) -> None:  # type: ignore[no-untyped-def]
    lm_port, api_port = free_port(), free_port()
    url = f"http://127.0.0.1:{api_port}"
    args = [AGENTSERVING, "kvserver", "--port", str(lm_port), "--api-port", str(api_port),
            "--max-gib", "0.001", "--log-level", "warning"]
    with service_process(args, f"{url}/healthz", log_path=tmp_path / "kvserver.log") as proc:
        for h in range(1, 9):
            _lm(lm_port, ClientCommand.PUT, h, bytes([h]) * 4096)
        assert httpx.get(f"{url}/v1/chunks").json()["total_chunks"] == 8
        run = fuzz(url, "kvserver", max_examples=30, extra=("--exclude-path", "/v1/pull"))
        tested = run.report["operations"]
        assert tested["tested"] == tested["total"] - 1, run.output[-4000:]  # all but the pull
        run.report["operations"]["total"] = tested["tested"]
        run.assert_clean()
        assert proc.poll() is None, "the KV server died during the fuzz run"
        _lm(lm_port, ClientCommand.PUT, 0x99, b"x" * 100)  # the protocol port still serves
        listing = httpx.get(f"{url}/v1/chunks").json()
        assert listing["used_bytes"] <= listing["capacity_bytes"]
        assert any(c["chunk_hash"] == "99" for c in listing["chunks"])
        assert all(is_chunk_hash(c["chunk_hash"]) for c in listing["chunks"])
