"""JSON in and out of the proxy's hot path.

A turn's body carries the whole prompt as token ids (thousands of ints); the proxy decodes it
once and encodes it twice (prefill, then decode), so the codec is a real part of its added
latency: msgspec does each in a fraction of the standard library's time. The standard library
stays the fallback, so the proxy runs where msgspec is not installed.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import msgspec

    _encoder = msgspec.json.Encoder()
    _decoder = msgspec.json.Decoder()

    def dumps(obj: Any) -> bytes:
        return _encoder.encode(obj)

    def loads(data: bytes | str) -> Any:
        """Raises ``ValueError`` (msgspec's DecodeError) on malformed input."""
        return _decoder.decode(data)

except ImportError:  # pragma: no cover - msgspec is in the proxy extra

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    def loads(data: bytes | str) -> Any:
        return json.loads(data)
