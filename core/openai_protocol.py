"""OpenAI-compatible request bodies, with AgentServing's extension fields: what the worker accepts
and the proxy documents in its OpenAPI (the contract between them, so it lives below both).

Types are strict (``"5"`` is not an int): a bad type is a 400 naming the field. Unknown
fields are ignored, as OpenAI clients send optional ones freely. Extensions:

- ``forced_output_token_ids``: teacher forcing — the engine emits exactly these tokens
  (computing their KV), so a replayed turn's context matches its trace;
- ``kv_transfer_params``: the P/D hand-off (vLLM's disaggregated-serving field);
- ``cache_salt``: the tenant's salt mixed into chunk hashes;
- ``ignore_eos``, ``stop_token_ids``, ``return_token_ids`` (vLLM's names).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator
from pydantic_core import PydanticCustomError

_MAX_TOKEN_ID = 2**31 - 1
_INT64 = (-(2**63), 2**63 - 1)  # what crosses to an engine process (msgpack) must fit
# The 400 code of an integer over 64 bits in kv_transfer_params: a limit of the engines that
# the schema, a free-form object, does not carry (declaring it needs a recursive schema)
INTEGER_OUT_OF_RANGE = "integer_out_of_range"
# A seed must fit in 64 bits; its bounds are JSON's safe integers, where every integer is
# exactly a float: OpenAPI writes bounds as floats, and a validator comparing 2**63 - 1 as a
# float would take 2**63 + 100 for a valid seed.
_SEED_BOUNDS = (-(2**53 - 1), 2**53 - 1)


def _integral(value: Any) -> Any:
    """JSON's integer is a number without a fraction, 5.0 included (JSON Schema says so, and
    a client's float formatting must not matter); "5" and true stay errors (strict types)."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]
# Bounds sit inside, where the schema shows them (outside, in an Optional, they would not).
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(_integral)]
Seed = Annotated[int, Field(ge=_SEED_BOUNDS[0], le=_SEED_BOUNDS[1]),
               BeforeValidator(_integral)]
TopLogprobs = Annotated[int, Field(ge=0, le=20), BeforeValidator(_integral)]
TokenId = Annotated[int, Field(ge=0, le=_MAX_TOKEN_ID), BeforeValidator(_integral)]

# What the validators below check, declared in the schema (a fuzzer or client generator reads
# it). The worker's own OpenAPI narrows token ids to its vocabulary (server.py).
TOKEN_ID_SCHEMA: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": _MAX_TOKEN_ID}
_TOKEN_IDS_SCHEMA: dict[str, Any] = {"type": "array", "items": TOKEN_ID_SCHEMA, "minItems": 1}
_STOP_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4},
    {"type": "null"}]}
_PROMPT_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "string", "minLength": 1},
    _TOKEN_IDS_SCHEMA,
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1,
     "description": "A batch of one prompt."},
    {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1, "maxItems": 1,
     "description": "A batch of one prompt of token ids."}]}
TokenIds = Annotated[list[Int], WithJsonSchema(
    {"anyOf": [{"type": "array", "items": TOKEN_ID_SCHEMA}, {"type": "null"}]})]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# Teacher forcing's tokens (every API that carries them: chat, completions, and the proxy's
# Messages and Responses front doors); at least one, each a token id.
ForcedTokenIds = Annotated[list[Int] | None, WithJsonSchema(
    {"anyOf": [_TOKEN_IDS_SCHEMA, {"type": "null"}]})]


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    model: str | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: Seed | None = None
    n: Int = Field(default=1, ge=1, le=1, description="Only one choice per request.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str] | None, WithJsonSchema(_STOP_SCHEMA)] = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    user: str | None = None
    forced_output_token_ids: ForcedTokenIds = Field(default=None, min_length=1)
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

    @field_validator("kv_transfer_params")
    @classmethod
    def _transferable(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        def walk(node: Any, path: str) -> None:
            if isinstance(node, int) and not isinstance(node, bool) and not (
                    _INT64[0] <= node <= _INT64[1]):
                raise PydanticCustomError(INTEGER_OUT_OF_RANGE,
                                          f"{path}: integer {node} does not fit in 64 bits")
            if isinstance(node, dict):
                for key, value in node.items():
                    walk(value, f"{path}.{key}")
            elif isinstance(node, list):
                for i, value in enumerate(node):
                    walk(value, f"{path}[{i}]")

        walk(v, "kv_transfer_params")
        return v

    @field_validator("forced_output_token_ids", "stop_token_ids")
    @classmethod
    def _token_ids(cls, v: list[int] | None) -> list[int] | None:
        for i, t in enumerate(v or []):
            if not 0 <= t <= _MAX_TOKEN_ID:
                raise ValueError(f"[{i}]: token id {t} out of range")
        return v


class CompletionRequest(SamplingFields):
    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)]
    logprobs: TopLogprobs | None = None
    echo: Annotated[bool, WithJsonSchema(
        {"type": "boolean", "enum": [False], "description": "Not supported."})] = False

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
            v = [_integral(t) for t in v]
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
    top_logprobs: TopLogprobs | None = None


def sse_data(line: str) -> str | None:
    """The payload of one line of an OpenAI stream when it is a ``data:`` line (``[DONE]``
    included), else None: the framing every streaming client here reads the same way."""
    return line[5:].strip() if line.startswith("data:") else None
