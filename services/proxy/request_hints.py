"""The ecosystem's per-request KV fields, read onto the project's own verbs (``agent_memory``).

- ``cache_control: {"type": "ephemeral", "ttl": "5m"}``, as Anthropic's API spells it at the
  top of a request and Dynamo under ``nvext.cache_control``: pin the session's KV for the TTL
  after the turn. Without a TTL the proxy sizes the pin from its tool-gap prediction
  (``tool_gaps.pin_ttl_for_gap``).
- Dynamo's ``nvext.agent_hints``: ``priority`` is the session's eviction priority after the
  turn (higher keeps its chunks against lower evictions, as in Dynamo); ``speculative_prefill``
  announces the session's next turn to its pod after this one, as a turn ending in a tool call
  is announced, so its KV is back in DRAM when the turn comes (the pod moves it; no token of
  the answer is computed ahead). ``osl``, ``strict_priority`` and ``latency_sensitivity`` have
  no verb here: they are validated and accepted, and change nothing. Unknown hints and other
  ``nvext`` fields are accepted and ignored, as Dynamo adds them.

Both fields are taken off the body before it goes to a pod; a bad one is a 400 naming it.
Harnesses add hints to every request, so a hint never overrides the agent's own
``agent_memory`` (its pin, priority, release or close win), and a top-level ``cache_control``
wins over ``nvext.cache_control``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
)

from agentserving.core.schemas import (
    PIN_TTL_XARG,
    CacheTtl,
    NonNegWireInt,
    Priority,
    WireInt,
    WireNumber,
)
from agentserving.core.service import ApiError, field_path
from agentserving.proxy.memory_hooks import AgentMemory


class CacheControl(BaseModel):
    """Keep this session's KV after the turn: a pin for ``ttl``, or, without one, for the
    proxy's predicted tool gap (between --pin-ttl-floor and --pin-ttl-cap)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["ephemeral"]
    ttl: CacheTtl | None = None


class AgentHints(BaseModel):
    """Dynamo's per-request agent hints (``nvext.agent_hints``)."""

    model_config = ConfigDict(extra="ignore")

    priority: Priority | None = Field(
        default=None, description="The session's eviction priority after the turn (as "
        "agent_memory.priority): an evict at or below it keeps the session's chunks.")
    speculative_prefill: StrictBool | None = Field(
        default=None, description="Announce the session's next turn to its pod after this "
        "one, so its KV is back in DRAM when the turn comes (as a turn ending in a tool call "
        "is announced).")
    osl: NonNegWireInt | None = Field(default=None, description="Expected output length in "
                                      "tokens: accepted; no effect yet.")
    strict_priority: WireInt | None = Field(default=None, description="Accepted; no effect.")
    latency_sensitivity: WireNumber | None = Field(default=None,
                                                   description="Accepted; no effect.")


class NvExt(BaseModel):
    """Dynamo's request extension: ``cache_control`` and ``agent_hints`` are read; its other
    fields are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    cache_control: CacheControl | None = None
    agent_hints: AgentHints | None = None


@dataclass(frozen=True)
class TurnHints:
    """What a turn's ecosystem fields ask for, resolved from wherever they were given."""

    pin: bool = False
    pin_ttl_s: float | None = None  # None with pin: size it from the tool-gap prediction
    priority: int | None = None
    speculative_prefill: bool = False


def validated_field(model: type[BaseModel], raw: Any, name: str) -> Any:
    """The body's field ``name`` as ``model``, or a 400 naming the field within it."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = f"{name}.{field_path(err['loc'])}" if err["loc"] else name
        raise ApiError(400, f"{param}: {err['msg']}", param=param) from exc


def read_hints(body: dict[str, Any]) -> TurnHints:
    """Take ``cache_control`` and ``nvext`` off ``body`` and resolve them (400 naming the
    field for a bad one); given at the top and under ``nvext``, the top one is the pin."""
    top = body.pop("cache_control", None)
    raw_ext = body.pop("nvext", None)
    ext = validated_field(NvExt, raw_ext, "nvext") if raw_ext is not None else NvExt()
    cache = validated_field(CacheControl, top, "cache_control") if top is not None else None
    cache = cache or ext.cache_control
    hints = ext.agent_hints or AgentHints()
    return TurnHints(pin=cache is not None, pin_ttl_s=cache.ttl if cache else None,
                     priority=hints.priority,
                     speculative_prefill=bool(hints.speculative_prefill))


def merged_memory(memory: AgentMemory | None, hints: TurnHints) -> AgentMemory | None:
    """``agent_memory`` with the hints' verbs added where it does not say otherwise: its own
    pin, priority, release or close take precedence (a close or a release makes a hint's pin
    moot, as a close makes a release moot), so a harness that adds hints to every request
    never overrides what the agent asked for."""
    if not hints.pin and hints.priority is None:
        return memory
    mem = memory or AgentMemory()
    update: dict[str, Any] = {}
    if hints.pin and not (mem.release or mem.close_session or mem.pin
                          or mem.pin_ttl_s is not None):
        update.update(pin_ttl_s=hints.pin_ttl_s, pin=hints.pin_ttl_s is None)
    if hints.priority is not None and mem.priority is None:
        update["priority"] = hints.priority
    return mem.model_copy(update=update) if update else memory


def with_pin_xarg(body: dict[str, Any], ttl_s: float) -> None:
    """Tell the pod the turn's pin (vLLM's extension args, ``vllm_xargs``; engines that do
    not read it ignore it), keeping what the caller put there."""
    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise ApiError(400, "vllm_xargs: must be an object", param="vllm_xargs")
    body["vllm_xargs"] = {**(xargs or {}), PIN_TTL_XARG: round(ttl_s, 3)}
