"""The decode side of the P/D hand-off: pull a prefill's KV and load it layer by layer.

``RemoteKV`` pulls ``GET http://remote_host:remote_port/v1/kv/{transfer_id}`` on a thread,
verifies every frame's checksum (``decode.handoff.wire``) and checks the header against
the decode request (same prompt ids, same model geometry). ``layerwise_cache`` builds a
transformers cache whose layer ``i`` waits for layer ``i`` to arrive the first time the
model touches it, so the first decode forward pass runs while later layers are still on the
wire (layer-wise load). Any failure surfaces as a ``TransferError`` from ``wait_header``,
``layer`` or the forward pass; the engine then recomputes the prompt locally — output is the
same either way, only slower.

A decode pod that already holds the prompt's first ``N`` tokens in its own tiers (the chunks of
the session's previous turn, kept after that turn's pull) passes them as ``prefix``: the pull
asks for tokens ``[N, num_tokens)`` only (``?start=N``), checks that the prefill's chunk hashes
agree with the local ones, and each layer is the local prefix followed by the pulled suffix.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx
import torch

from agentserving.decode.handoff.wire import (
    Decoder,
    TransferCorrupt,
    TransferError,
    TransferMismatch,
    dtype_name,
    tokens_digest,
)

__all__ = ["RemoteKV", "layerwise_cache", "TransferError"]


class RemoteKV:
    def __init__(self, params: dict[str, Any], prompt_token_ids: Sequence[int], *,
                 num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 timeout_s: float,
                 prefix: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 prefix_chunk_hashes: Sequence[str] = ()) -> None:
        try:
            host, port = params["remote_host"], int(params["remote_port"])
            self.transfer_id = str(params["transfer_id"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferMismatch(f"kv_transfer_params lacks {exc}") from exc
        self.prefix = list(prefix) if prefix else None
        self.start_token = int(self.prefix[0][0].shape[2]) if self.prefix else 0
        if self.prefix is not None and len(self.prefix) != num_layers:
            raise TransferMismatch(f"local prefix has {len(self.prefix)} layers, "
                                   f"not {num_layers}")
        if self.start_token > len(prompt_token_ids):
            raise TransferMismatch("local prefix is longer than the prompt")
        self._prefix_hashes = list(prefix_chunk_hashes)
        self.url = f"http://{host}:{port}/v1/kv/{self.transfer_id}"
        if self.start_token:
            self.url += f"?start={self.start_token}"
        self._expect = {"num_tokens": len(prompt_token_ids), "num_layers": num_layers,
                        "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                        "dtype": dtype_name(dtype),
                        "tokens_digest": tokens_digest(prompt_token_ids),
                        "start_token": self.start_token}
        self.num_layers = num_layers
        self.timeout_s = timeout_s
        self.header: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.bytes_received = 0
        self.started_at = time.perf_counter()
        self.finished_at: float | None = None
        self._layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self._cond = threading.Condition()
        self._done = False
        self._thread = threading.Thread(target=self._run, name=f"kv-pull-{self.transfer_id[:8]}",
                                        daemon=True)

    def start(self) -> RemoteKV:
        self._thread.start()
        return self

    # -- receiving thread
    def _run(self) -> None:
        dec = Decoder()
        try:
            with httpx.stream("GET", self.url, timeout=self.timeout_s) as resp:
                if resp.status_code != 200:
                    raise TransferError(f"GET {self.url}: HTTP {resp.status_code}")
                for data in resp.iter_raw(1 << 20):
                    for event in dec.feed(data):
                        self._on_event(event)
                    self.bytes_received = dec.bytes_received
                dec.finish()
        except httpx.HTTPError as exc:
            self._fail(TransferError(f"GET {self.url}: {exc!r}"))
        except TransferError as exc:
            self._fail(exc)
        except Exception as exc:  # noqa: BLE001 - any failure means: recompute
            self._fail(TransferError(repr(exc)))
        finally:
            self.bytes_received = dec.bytes_received
            self.finished_at = time.perf_counter()
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def _on_event(self, event: tuple) -> None:
        kind = event[0]
        if kind == "layer":
            k, v = event[2], event[3]
            if self.prefix is not None:  # the local prefix, then the pulled suffix
                pk, pv = self.prefix[event[1]]
                k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
            with self._cond:
                self._layers[event[1]] = (k, v)
                self._cond.notify_all()
            return
        if kind == "header":
            header = event[1]
            got = {**header, "start_token": int(header.get("start_token") or 0)}
            for field, want in self._expect.items():
                if got.get(field) != want:
                    raise TransferMismatch(f"hand-off {field} is {got.get(field)!r}, "
                                           f"this request needs {want!r}")
            theirs = list(header.get("chunk_hashes") or [])[: len(self._prefix_hashes)]
            if theirs != self._prefix_hashes:
                raise TransferMismatch("the prefill's chunk hashes differ from the local "
                                       "prefix's")
        with self._cond:
            if kind == "header":
                self.header = event[1]
            self._cond.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self.error is None:
                self.error = exc
            self._cond.notify_all()

    # -- consumers (the engine's step loop)
    def _wait(self, ready: Any, what: str) -> Any:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while True:
                if self.error is not None:
                    raise self.error if isinstance(self.error, TransferError) else \
                        TransferError(repr(self.error))
                value = ready()
                if value is not None:
                    return value
                if self._done:
                    raise TransferCorrupt(f"hand-off ended without {what}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"timed out waiting for {what}")
                self._cond.wait(left)

    def header_ready(self) -> bool:
        with self._cond:
            return self.header is not None or self.error is not None or self._done

    def done(self) -> bool:
        """Every frame has arrived (or the pull failed): nothing left to wait for."""
        with self._cond:
            return self._done

    def wait_header(self) -> dict[str, Any]:
        return self._wait(lambda: self.header, "the header")

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._wait(lambda: self._layers[idx], f"layer {idx}")

    def wait_done(self) -> None:
        self._wait(lambda: True if self._done and self.error is None else None, "the end")

    @property
    def seconds(self) -> float:
        return (self.finished_at or time.perf_counter()) - self.started_at

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self.wait_done()
        return [self.layer(i) for i in range(self.num_layers)]


def layerwise_cache(config: Any, remote: RemoteKV, num_tokens: int) -> Any:
    """A DynamicCache whose layer i blocks on ``remote.layer(i)`` when the model first uses it."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class RemoteLayer(DynamicLayer):
        def __init__(self, idx: int) -> None:
            super().__init__()
            self._idx = idx

        def _materialize(self) -> None:
            if not self.is_initialized:
                k, v = remote.layer(self._idx)
                self.lazy_initialization(k, v)
                self.keys, self.values = k, v

        def update(self, key_states, value_states, *args, **kwargs):  # type: ignore[no-untyped-def]
            self._materialize()
            return super().update(key_states, value_states, *args, **kwargs)

        def get_seq_length(self) -> int:
            return num_tokens if not self.is_initialized else super().get_seq_length()

    cache = DynamicCache(config=config)
    cache.layers = [RemoteLayer(i) for i in range(len(cache.layers))]
    return cache
