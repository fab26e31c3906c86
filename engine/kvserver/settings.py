"""The KV server's configuration: built from CLI flags / environment by ``cli.py``, then passed
to constructors. No other module reads the environment."""

from __future__ import annotations

from pydantic import BaseModel, Field

GIB = 1024**3


class KvServerSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(default=65432, ge=0, le=65535, description="LMCache protocol port.")
    api_port: int = Field(default=65433, ge=0, le=65535, description="HTTP API port.")
    max_gib: float = Field(default=2.0, gt=0, description="The byte bound, GiB.")
    pin_share: float = Field(default=0.5, ge=0, le=1, description="Share of the bound pinned "
                             "chunks may hold out of the LRU.")
    pull_timeout_s: float = Field(default=30.0, gt=0)
    max_batch_chunks: int = Field(default=65536, gt=0)
    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    internal_token: str | None = Field(default=None, repr=False)
    log_level: str = "info"
    log_json: bool = True

    @property
    def capacity_bytes(self) -> int:
        return max(1, int(self.max_gib * GIB))
