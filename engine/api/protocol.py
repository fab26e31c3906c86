"""OpenAI-compatible request bodies of the worker, with AgentServing's extension fields.

Types are strict (``"5"`` is not an int): a bad type is a 400 naming the field. Unknown
fields are ignored, as OpenAI clients send optional ones freely. Extensions:

- ``forced_output_token_ids``: teacher forcing — the engine emits exactly these tokens
  (computing their KV), so a replayed turn's context matches its trace;
- ``kv_transfer_params``: the P/D hand-off (vLLM's disaggregated-serving field);
- ``cache_salt``: the tenant's salt mixed into chunk hashes;
- ``ignore_eos``, ``stop_token_ids``, ``return_token_ids`` (vLLM's names).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_MAX_TOKEN_ID = 2**31 - 1


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1, description="Only one choice per request.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    user: str | None = None
    forced_output_token_ids: list[int] | None = Field(default=None, min_length=1)
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    return_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty stop strings")
        return stops

    @field_validator("forced_output_token_ids", "stop_token_ids")
    @classmethod
    def _token_ids(cls, v: list[int] | None) -> list[int] | None:
        for i, t in enumerate(v or []):
            if not 0 <= t <= _MAX_TOKEN_ID:
                raise ValueError(f"[{i}]: token id {t} out of range")
        return v


class CompletionRequest(SamplingFields):
    prompt: Any
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list):
            v = v[0]  # a batch of one
        if isinstance(v, str):
            if not v:
                raise ValueError("prompt is empty")
            return v
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt is empty")
            for i, t in enumerate(v):
                if type(t) is not int or not 0 <= t <= _MAX_TOKEN_ID:
                    raise ValueError(f"prompt[{i}]: expected a token id (non-negative integer), "
                                     f"got {t!r}")
            return v
        raise ValueError("expected a string or a list of token ids")

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
