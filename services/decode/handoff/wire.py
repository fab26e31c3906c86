"""The binary format of a prefill -> decode KV hand-off, layer by layer, every frame checksummed.

    stream  := MAGIC header-frame layer-frame{num_layers} end-frame
    frame   := u32 big-endian payload length | payload | blake3(payload)[:16]
    header  := JSON: transfer_id, model, num_tokens, num_layers, num_kv_heads, head_dim, dtype,
               tokens_digest (blake3 of the prompt ids as big-endian u32), chunk_hashes,
               first_token_id, first_logprob, first_top_logprobs, start_token (optional, 0)
    layer i := keys then values of layer i, each [kv_heads, num_tokens - start_token, head_dim],
               raw bytes: the prompt's tokens [start_token, num_tokens)
    end     := JSON {"end": true, "num_layers": n}

A decode pod that already holds the prompt's first chunks (a session's previous turn) asks
for the rest only (``start_token``); the frames then carry just that suffix.

Layers come in model order so the receiver can run the first forward pass while later layers
are still on the wire (layer-wise load). A frame whose checksum does not match, a short
stream, or a header that does not describe the receiver's request raises
``TransferCorrupt`` / ``TransferMismatch``; the receiver then recomputes instead.
"""

from __future__ import annotations

import json
import struct
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import blake3
import numpy as np
import torch

MAGIC = b"ASKV\x01"
DIGEST = 16
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_NAMES = {v: k for k, v in _DTYPES.items()}


class TransferError(Exception):
    pass


class TransferCorrupt(TransferError):
    pass


class TransferMismatch(TransferError):
    pass


def tokens_digest(tokens: Sequence[int]) -> str:
    return blake3.blake3(struct.pack(f">{len(tokens)}I", *tokens)).hexdigest(length=16)


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES[dtype]


def _frame(*parts: bytes | memoryview) -> Iterator[bytes | memoryview]:
    """One frame as pieces (no copy of the payload)."""
    h = blake3.blake3()
    size = 0
    for p in parts:
        h.update(p)
        size += len(p)
    yield struct.pack(">I", size)
    yield from parts
    yield h.digest(length=DIGEST)


def suffix_tokens(header: dict[str, Any]) -> int:
    """How many tokens each layer frame of a stream with this header carries."""
    return int(header["num_tokens"]) - int(header.get("start_token") or 0)


def _raw(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:  # a suffix of no tokens (memoryview cannot cast a zero-size shape)
        return memoryview(b"")
    return memoryview(t.contiguous().numpy()).cast("B")


def encode(header: dict[str, Any], layers: Sequence[tuple[torch.Tensor, torch.Tensor]]
           ) -> Iterator[bytes | memoryview]:
    """The stream for ``layers`` ([1, kv_heads, tokens, head_dim] each), piece by piece;
    layer payloads are views of the tensors, not copies."""
    yield MAGIC
    yield from _frame(json.dumps(header).encode())
    for k, v in layers:
        yield from _frame(_raw(k[0]), _raw(v[0]))
    yield from _frame(json.dumps({"end": True, "num_layers": len(layers)}).encode())


class Decoder:
    """Incremental parser: ``feed(bytes)`` returns the events completed so far:
    ``("header", dict)``, ``("layer", index, keys, values)``, ``("end", dict)``.
    Each frame is assembled once (no re-copying of a growing buffer) and the layer tensors are
    views of it."""

    def __init__(self) -> None:
        self._pending: deque[memoryview] = deque()  # received, not yet in a frame
        self._have = 0
        self._magic_seen = False
        self._size: int | None = None  # payload size of the frame being read
        self.header: dict[str, Any] | None = None
        self._layer = 0
        self.done = False
        self.bytes_received = 0

    def _take(self, n: int) -> bytearray | None:
        """The next ``n`` bytes as one buffer of their own, once that many have arrived. Every
        received byte is copied exactly once, by numpy (which releases the GIL for large
        copies): the decoder runs on a pull thread beside the engine's decode loop."""
        if self._have < n:
            return None
        out = bytearray(n)
        dst = np.frombuffer(out, dtype=np.uint8) if n else None
        filled = 0
        while filled < n:
            piece = self._pending[0]
            k = min(len(piece), n - filled)
            dst[filled:filled + k] = np.frombuffer(piece[:k], dtype=np.uint8)
            filled += k
            if k == len(piece):
                self._pending.popleft()
            else:
                self._pending[0] = piece[k:]
        self._have -= n
        return out

    def feed(self, data: bytes) -> list[tuple]:
        self.bytes_received += len(data)
        if data:
            # our own immutable copy unless it is bytes already (a caller may reuse its buffer)
            self._pending.append(memoryview(data if isinstance(data, bytes) else bytes(data))
                                 .cast("B"))
            self._have += len(data)
        events: list[tuple] = []
        if not self._magic_seen:
            magic = self._take(len(MAGIC))
            if magic is None:
                return events
            if bytes(magic) != MAGIC:
                raise TransferCorrupt("not a KV hand-off stream (bad magic)")
            self._magic_seen = True
        while not self.done:
            if self._size is None:
                head = self._take(4)
                if head is None:
                    break
                (self._size,) = struct.unpack(">I", head)
                if self.header is not None and self._size > self._max_frame():
                    raise TransferCorrupt(f"frame of {self._size} bytes exceeds the header's "
                                          "layer size")
            frame = self._take(self._size + DIGEST)
            if frame is None:
                break
            size, self._size = self._size, None
            payload = memoryview(frame)[:size]
            if blake3.blake3(payload).digest(length=DIGEST) != bytes(frame[size:]):
                raise TransferCorrupt("frame checksum mismatch "
                                      f"({'header' if self.header is None else 'layer'} "
                                      f"{self._layer})")
            events.append(self._event(frame, size))
        return events

    def finish(self) -> None:
        if not self.done:
            raise TransferCorrupt("KV hand-off stream ended early "
                                  f"(after {self._layer} layers)")

    def _max_frame(self) -> int:
        h = self.header or {}
        item = torch.empty((), dtype=_DTYPES[h["dtype"]]).element_size()
        return max(2 * h["num_kv_heads"] * suffix_tokens(h) * h["head_dim"] * item, 1 << 16)

    def _event(self, frame: bytearray, size: int) -> tuple:
        payload = bytes(frame[:size]) if self.header is None or \
            self._layer == self.header["num_layers"] else None
        if self.header is None:
            try:
                header = json.loads(payload)
                header["num_tokens"], header["num_layers"]  # noqa: B018 - required fields
                dtype = _DTYPES[header["dtype"]]
                if not 0 <= int(header.get("start_token") or 0) <= int(header["num_tokens"]):
                    raise ValueError("start_token outside the prompt")
            except (ValueError, KeyError, TypeError) as exc:
                raise TransferCorrupt(f"bad hand-off header: {exc!r}") from exc
            self.header = header
            self._dtype = dtype
            return ("header", header)
        h = self.header
        if self._layer == h["num_layers"]:
            end = json.loads(payload)
            if not end.get("end") or end.get("num_layers") != h["num_layers"]:
                raise TransferCorrupt("bad end frame")
            self.done = True
            return ("end", end)
        shape = (1, h["num_kv_heads"], suffix_tokens(h), h["head_dim"])
        item = torch.empty((), dtype=self._dtype).element_size()
        count = shape[1] * shape[2] * shape[3]
        if size != 2 * count * item:
            raise TransferCorrupt(f"layer {self._layer}: {size} bytes, wrong size")
        if count == 0:  # the receiver held every token already
            k = torch.empty(shape, dtype=self._dtype)
            v = torch.empty(shape, dtype=self._dtype)
        else:
            k = torch.frombuffer(frame, dtype=self._dtype, count=count).view(shape)
            v = torch.frombuffer(frame, dtype=self._dtype, count=count,
                                 offset=count * item).view(shape)
        idx = self._layer
        self._layer += 1
        return ("layer", idx, k, v)
