"""Messages between the API process and its engine processes (msgpack over ZMQ PUSH/PULL).

The API process binds one PUSH socket per engine (requests in) and one PULL socket that every
engine connects to (outputs, residency and stats out). Addresses are ``ipc://`` paths in a
private temporary directory. Every message is a tagged ``msgspec.Struct``.
"""

from __future__ import annotations

from typing import Any

import msgspec


class AddRequest(msgspec.Struct, tag=True):
    req_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    logprobs: int | None = None
    forced_output_token_ids: list[int] | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    arrival_time: float = 0.0


class Abort(msgspec.Struct, tag=True):
    req_id: str


class Shutdown(msgspec.Struct, tag=True):
    pass


class TokenItem(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class OutputItem(msgspec.Struct):
    req_id: str
    tokens: list[TokenItem]
    finished: bool = False
    finish_reason: str | None = None
    meta: dict[str, Any] = {}
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None


class Outputs(msgspec.Struct, tag=True):
    engine: int
    items: list[OutputItem]


class Ready(msgspec.Struct, tag=True):
    engine: int
    memory_port: int
    weights_digest: str
    max_model_len: int
    chunk_bytes: int
    capacity_bytes: dict[str, int]
    backends: list[str]


class Residency(msgspec.Struct, tag=True):
    """A change of what the engine's tiers hold (``full``: a complete listing instead)."""

    engine: int
    stored: dict[str, list[str]]
    removed: dict[str, list[str]]
    bytes: dict[str, int]
    full: bool = False


class Stats(msgspec.Struct, tag=True):
    engine: int
    waiting: int
    running: int
    counters: dict[str, float]


class Fatal(msgspec.Struct, tag=True):
    engine: int
    error: str


ToEngine = AddRequest | Abort | Shutdown
FromEngine = Outputs | Ready | Residency | Stats | Fatal

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_engine(data: bytes) -> ToEngine:
    return _to_engine.decode(data)


def decode_from_engine(data: bytes) -> FromEngine:
    return _from_engine.decode(data)
