"""A KV server (``agentserving kvserver``'s app) on loopback for tests, and LMCache's own
``lm://`` client to talk to it (``LmClient``): the pieces the KV server's tests and benches
share."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from dataclasses import dataclass

import httpx

from agentserving.engine.kvserver.app import create_app
from agentserving.engine.kvserver.settings import KvServerSettings
from agentserving.engine.kvserver.store import BlobStore
from testkit.servers import ThreadedServer, free_port

MODEL = "kvs-test"
CHUNK_TOKENS = 16
# layers, K/V, tokens, hidden (heads x head dim): a chunk of 2 x 2 x 16 x 16 fp16 = 2 KiB
KV_SHAPE = (2, 2, CHUNK_TOKENS, 16)
CHUNK_BYTES = 2 * 2 * CHUNK_TOKENS * 16 * 2


@dataclass
class KvServer:
    http: ThreadedServer
    lm_port: int
    store: BlobStore

    @property
    def url(self) -> str:
        return self.http.url

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of this server's /metrics (0 when absent)."""
        text = httpx.get(f"{self.url}/metrics").text
        pattern = rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$"
        found = re.search(pattern, text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0


def start_kvserver(capacity_bytes: int = 1 << 20, **settings: object) -> KvServer:
    """The app served by uvicorn on a free port (its HTTP API), its LMCache protocol server on
    another (``lm_port``); stop with ``.http.stop()``."""
    lm_port = free_port()
    cfg = KvServerSettings(port=lm_port, log_level="warning", **settings)  # type: ignore[arg-type]
    store = BlobStore(capacity_bytes, cfg.pin_share)
    return KvServer(ThreadedServer(create_app(cfg, store)), lm_port, store)


class LmClient:
    """LMCache's client for ``lm://`` URLs (``CreateConnector`` -> ``LMCServerConnector``) with
    the CPU backend it allocates received chunks from, driven on its own event loop thread as
    LMCache's remote backend drives it."""

    def __init__(self, port: int) -> None:
        import torch
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.connector import CreateConnector
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self.config = LMCacheEngineConfig.from_dict(
            {"chunk_size": CHUNK_TOKENS, "max_local_cpu_size": 0.05, "local_cpu": False})
        self.metadata = LMCacheMetadata(
            model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=torch.float16, kv_shape=(2, 2, CHUNK_TOKENS, 2, 8),
            chunk_size=CHUNK_TOKENS)
        self.backend = LocalCPUBackend(self.config, self.metadata)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.connector = self._run(self._create(CreateConnector, port))
        self._objs: list = []  # handed back to the allocator on close

    async def _create(self, create, port: int):  # type: ignore[no-untyped-def]
        return create(f"lm://127.0.0.1:{port}", self.loop, self.backend, self.config,
                      self.metadata)

    def _run(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    @staticmethod
    def key(chunk_hash: int, worker_id: int = 0):  # type: ignore[no-untyped-def]
        import torch
        from lmcache.utils import CacheEngineKey

        return CacheEngineKey(MODEL, 1, worker_id, chunk_hash, torch.float16)

    def chunk(self, seed: int):  # type: ignore[no-untyped-def]
        """A MemoryObj of one full chunk, filled with values drawn from ``seed``."""
        import torch

        obj = self.backend.allocate(torch.Size(KV_SHAPE), torch.float16)
        assert obj is not None
        gen = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(KV_SHAPE, generator=gen, dtype=torch.float32))
        self._objs.append(obj)
        return obj

    def put(self, key, obj) -> None:  # type: ignore[no-untyped-def]
        self._run(self.connector.put(key, obj))

    def get(self, key):  # type: ignore[no-untyped-def]
        obj = self._run(self.connector.get(key))
        if obj is not None:
            self._objs.append(obj)
        return obj

    def exists(self, key) -> bool:  # type: ignore[no-untyped-def]
        return self._run(self.connector.exists(key))

    def close(self) -> None:
        self._run(self.connector.close())
        for obj in self._objs:
            obj.ref_count_down()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def raw_connection(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        piece = sock.recv(n - len(out))
        if not piece:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += piece
    return bytes(out)
