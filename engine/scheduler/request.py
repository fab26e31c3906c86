"""A request as the engine process sees it: prompt ids, sampling, and its progress."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

from agentserving.core.schemas import Tier


class RequestState(enum.StrEnum):
    WAITING = "waiting"        # queued; its cached prefix is fetched when first scheduled
    PULLING = "pulling"        # decode role: KV is arriving from a prefill pod
    PREFILLING = "prefilling"  # some of the prompt is in its KV cache, the rest is not
    DECODING = "decoding"
    FINISHED = "finished"


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float | None = None  # None or 0: greedy
    top_p: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: no logprobs; n >= 0: the chosen token's plus top n
    forced_output_token_ids: tuple[int, ...] | None = None


@dataclasses.dataclass
class EngineRequest:
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    arrival_time: float = dataclasses.field(default_factory=time.time)

    # -- progress (owned by the engine core)
    state: RequestState = RequestState.WAITING
    cache: Any = None
    num_computed: int = 0
    chunk_ints: list[int] = dataclasses.field(default_factory=list)
    chunk_hashes: list[str] = dataclasses.field(default_factory=list)
    reused_tokens: int = 0
    tokens_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    stored_chunks: int = 0
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    pending_logits: Any = None
    scheduled_time: float | None = None
    first_token_time: float | None = None
    prefill_seconds: float = 0.0
    load_seconds: float = 0.0
    decode_seconds: float = 0.0
    remote: Any = None  # decode role: the KV hand-off in flight
    pull_open: Any = None  # decode role: Future of the local-prefix read + pull start
    kv_load: Any = None  # decode role: the layer-wise copy of the pulled KV into blocks
    prepared: Any = None  # (PagedKV, reused tokens, layer wait) started while queued
    aborted: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prefill_remaining(self) -> int:
        return max(0, self.num_prompt_tokens - self.num_computed)

    @property
    def wants_remote_decode(self) -> bool:
        return bool((self.kv_transfer_params or {}).get("do_remote_decode"))

    @property
    def wants_remote_prefill(self) -> bool:
        return bool((self.kv_transfer_params or {}).get("do_remote_prefill"))

    @property
    def output_budget(self) -> int:
        forced = self.sampling.forced_output_token_ids
        return len(forced) if forced is not None else self.sampling.max_tokens

    def cached_tokens(self) -> int:
        return sum(self.tokens_by_tier.values())

    def add_tier_tokens(self, tier: Tier | str, n: int) -> None:
        name = tier.value if isinstance(tier, Tier) else tier
        if n:
            self.tokens_by_tier[name] = self.tokens_by_tier.get(name, 0) + n
