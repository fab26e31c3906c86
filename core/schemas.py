"""Wire contracts shared by servers and their clients: one pydantic model per body.

A field is named once, here; the kvindex, the workers' memory API and the proxy import these
models, and so do the HTTP clients that talk to them.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    WithJsonSchema,
)

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE, HashScheme, is_chunk_hash


class Tier(StrEnum):
    """Where a chunk lives on a pod, fastest first."""

    DEVICE = "device"
    CPU = "cpu"
    DISK = "disk"


TIERS_FASTEST_FIRST: tuple[Tier, ...] = (Tier.DEVICE, Tier.CPU, Tier.DISK)

# LMCache's storage backends behind each tier (the memory API's "locations").
TIER_BACKENDS: dict[Tier, str] = {
    Tier.CPU: "LocalCPUBackend",
    Tier.DISK: "LocalDiskBackend",
}


# Evict locations: tier names or LMCache backend names (the handlers check them, naming the
# bad one; the schemas list them). A pod's memory API has no device tier to evict from.
EVICT_LOCATIONS = sorted([t.value for t in Tier] + list(TIER_BACKENDS.values()))
POD_EVICT_LOCATIONS = sorted([t.value for t in TIER_BACKENDS] + list(TIER_BACKENDS.values()))
EvictLocation = Annotated[str, WithJsonSchema({"type": "string", "enum": EVICT_LOCATIONS})]
PodEvictLocation = Annotated[str, WithJsonSchema({"type": "string",
                                                  "enum": POD_EVICT_LOCATIONS})]


def _wire_int(value: object) -> object:
    """JSON's integer, as its schema means it: 5 and 5.0, never "5" nor true."""
    if isinstance(value, str | bool):
        raise ValueError("expected an integer")
    return value


def _wire_number(value: object) -> object:
    """JSON's number: 2 and 2.5, never "2" nor true."""
    if isinstance(value, str | bool):
        raise ValueError("expected a number")
    return value


# An integer on the wire: pydantic's lax int without its str/bool coercions.
WireInt = Annotated[int, BeforeValidator(_wire_int)]
# A number on the wire: 2 and 2.5, never "2" nor true.
WireNumber = Annotated[float, BeforeValidator(_wire_number)]
# The bound sits inside, where the schema shows it as "minimum" (outside a union or a mapping's
# values it would not).
NonNegWireInt = Annotated[int, Field(ge=0), BeforeValidator(_wire_int)]

# A session's eviction priority: an evict at priority p skips chunks that a live session of
# priority >= p references (kvindex.index.base.protected_chunks). Bounded so the schema is finite.
DEFAULT_PRIORITY = 0
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000
Priority = Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY), BeforeValidator(_wire_int)]
# How long a pin may hold a session's chunks: a predicted tool gap, not forever (a day at most).
MAX_PIN_TTL_S = 86400.0
# JSON's number for a duration: 2 and 2.5, never "2" nor true (a float field would coerce both).
PinTtl = Annotated[float, Field(gt=0, le=MAX_PIN_TTL_S), BeforeValidator(_wire_number)]
# The pin a turn asks its vLLM pod for, in vLLM's extension args (``vllm_xargs``): the proxy
# sends it, the pod's scheduler keeps the turn's blocks that long (engine.vllm.device_kv).
PIN_TTL_XARG = "agentserving_pin_ttl_s"
# Where a turn's prompt tokens came from (device, DRAM, disk, KV server, computed) and how long
# its loads held it, in a vLLM pod's answer's ``kv_transfer_params`` (engine.vllm.prompt_sources).
PROMPT_SOURCES_PARAM = "prompt_sources"
# A cache TTL as Anthropic's API and Dynamo's nvext spell it ('30s', '5m', '1h') or seconds.
TTL_PATTERN = r"^[1-9][0-9]*[smh]$"
_TTL = re.compile(TTL_PATTERN)
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_ttl(value: object) -> object:
    """'30s', '5m', '1h' (Anthropic's and Dynamo's spelling) or a number of seconds -> seconds;
    anything else is left for the float field to reject."""
    if isinstance(value, bool):
        raise ValueError("expected a duration like '5m', '1h', '30s' or a number of seconds")
    if isinstance(value, str):
        if _TTL.fullmatch(value) is None:
            raise ValueError("expected a duration like '5m', '1h', '30s' or a number of "
                             "seconds")
        return float(value[:-1]) * _UNIT_S[value[-1]]
    return value


def _at_most_a_day(ttl_s: float) -> float:
    """A pin holds for a predicted tool gap, not forever: a longer TTL is cut to a day."""
    return min(ttl_s, MAX_PIN_TTL_S)


CacheTtl = Annotated[
    float, Field(gt=0), BeforeValidator(parse_ttl), AfterValidator(_at_most_a_day),
    WithJsonSchema({"anyOf": [{"type": "number", "exclusiveMinimum": 0},
                              {"type": "string", "pattern": TTL_PATTERN}],
                    "description": "How long to keep the KV: '30s', '5m', '1h', or seconds; "
                                   f"longer than {MAX_PIN_TTL_S:g} s is cut to that."})]


class PodRole(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


def _check_chunk_hash(value: str) -> str:
    if not is_chunk_hash(value):
        raise ValueError(
            "not a chunk hash: expected lower-case hex (optionally '-'-signed), 1-64 digits"
        )
    return value


# The schemas declare what the validators check (a fuzzer or a client generator reads them);
# the validators keep their own messages, clearer than pydantic's "should match pattern".
CHUNK_HASH_PATTERN = r"^-?[0-9a-f]{1,64}$"

ChunkHash = Annotated[str, AfterValidator(_check_chunk_hash), WithJsonSchema({
    "type": "string", "pattern": CHUNK_HASH_PATTERN,
    "description": "A chunk hash: lower-case hex, 1-64 digits, optionally '-'-signed."})]

POD_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$"
_POD_NAME = re.compile(POD_NAME_PATTERN)


def _check_pod_name(value: str) -> str:
    if not _POD_NAME.fullmatch(value):  # match() would let a trailing newline through
        raise ValueError("pod name must be 1-253 characters of [A-Za-z0-9._-], starting alnum")
    return value


PodName = Annotated[str, AfterValidator(_check_pod_name), WithJsonSchema({
    "type": "string", "pattern": POD_NAME_PATTERN,
    "description": "1-253 characters of [A-Za-z0-9._-], starting alphanumeric."})]

# No \s: it means more characters in Python than in the schema's (ECMA) regexes, e.g. U+0085.
HTTP_URL_PATTERN = r"^https?://[^/\x00-\x20\x7f]"


def _check_http_url(value: str) -> str:
    if not re.match(HTTP_URL_PATTERN, value):
        raise ValueError("must be an http(s):// URL")
    return value.rstrip("/")


HttpUrlStr = Annotated[str, AfterValidator(_check_http_url), WithJsonSchema({
    "type": "string", "pattern": HTTP_URL_PATTERN, "description": "An http(s):// URL."})]


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, not_found_error, conflict_error, ...")
    param: str | None = Field(default=None, description="The offending field, e.g. "
                              "'chunk_hashes[3]'.")
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error answer of every service, in OpenAI's shape."""

    error: ErrorDetail


class Strict(BaseModel):
    """Unknown fields are errors: a typo in a field name must not pass silently. Numbers and
    flags use WireInt/StrictBool: ``"5"`` or ``0`` where the schema says integer or boolean
    is a 400 naming the field, not a silent coercion."""

    model_config = ConfigDict(extra="forbid")


# The tenant a kvindex call acts for: the proxy sets it from the caller's API key, and the
# kvindex keeps that tenant's sessions apart (``kvindex.http_apis.scope``), so one tenant's
# session ids never name another's. No header: the unscoped namespace (a single-tenant fleet).
TENANT_HEADER = "x-agentserving-tenant"
TENANT_PATTERN = r"^[A-Za-z0-9._@:-]{1,128}$"
# A session id names a session within its tenant: no '/', the separator of a tenant's scope.
SESSION_ID_PATTERN = r"^[^/]{1,256}$"
SessionId = Annotated[str, Field(pattern=SESSION_ID_PATTERN)]
# A stored response's id (the Responses API's ``resp_<hex>``): path-safe, and without '/', so a
# tenant-scoped key never collides with an unscoped one.
RESPONSE_ID_PATTERN = r"^[A-Za-z0-9_-]{1,256}$"


# ---------------------------------------------------------------- pods


class PodRegistration(Strict):
    pod: PodName
    memory_api_url: HttpUrlStr = Field(description="Base URL of the pod's memory API (:6999).")
    api_url: HttpUrlStr | None = Field(
        default=None, description="Base URL of the pod's OpenAI-compatible API, for the proxy."
    )
    role: PodRole = PodRole.BOTH
    model: str = Field(min_length=1)
    hash_scheme: HashScheme = HashScheme.BLAKE3
    chunk_size: WireInt = Field(default=DEFAULT_CHUNK_SIZE, gt=0)
    capacity_bytes: dict[Tier, NonNegWireInt] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)


class PodInfo(PodRegistration):
    registered_at: float
    last_heartbeat: float
    lease_expires_at: float
    seq: int = Field(description="Last residency batch sequence number applied.")
    needs_resync: bool = Field(description="A sequence gap was seen: send a full snapshot.")
    chunks: dict[Tier, int] = Field(default_factory=dict)
    used_bytes: dict[Tier, int] = Field(default_factory=dict)


class PodList(BaseModel):
    pods: list[PodInfo]


class LeaseInfo(BaseModel):
    pod: str
    lease_expires_at: float
    seq: int
    needs_resync: bool


# ---------------------------------------------------------------- residency


class EventOp(StrEnum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


class ResidencyEvent(Strict):
    # the schema says what model_post_init checks: a tier unless the op is 'cleared'
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"op": {"enum": [EventOp.STORED.value, EventOp.REMOVED.value]}}},
        "then": {"required": ["tier"], "properties": {"tier": {"not": {"type": "null"}}}},
    })

    op: EventOp
    tier: Tier | None = Field(default=None, description="Required unless op is 'cleared'.")
    chunk_hashes: list[ChunkHash] = Field(default_factory=list)
    bytes: NonNegWireInt | None = Field(default=None,
                                        description="Total bytes of these chunks.")

    def model_post_init(self, _context: object) -> None:
        if self.op is not EventOp.CLEARED and self.tier is None:
            raise ValueError(f"tier: required for op '{self.op}'")


class EventBatch(Strict):
    pod: PodName
    seq: WireInt = Field(ge=0)
    events: list[ResidencyEvent]


class EventBatchResult(BaseModel):
    pod: str
    seq: int
    applied: bool = Field(description="False when this seq was already applied (a replay).")
    chunk_events: int
    needs_resync: bool


class ChunkSnapshot(Strict):
    """A pod's full residency, replacing whatever the index holds for it."""

    seq: WireInt = Field(ge=0)
    chunks: dict[Tier, list[ChunkHash]]
    bytes: dict[Tier, NonNegWireInt] = Field(default_factory=dict)


class ChunkLocation(BaseModel):
    pod: str
    tier: Tier


class ChunkLocations(BaseModel):
    chunk_hash: str
    locations: list[ChunkLocation]


class LookupRequest(Strict):
    chunk_hashes: list[ChunkHash] = Field(description="A prefix chain, in order.")
    pods: list[str] | None = Field(default=None, description="Only consider these pods.")
    role: PodRole | None = Field(
        default=None, description="Only consider pods serving this role ('both' pods match)."
    )


class PodPrefix(BaseModel):
    pod: str
    prefix_chunks: int = Field(description="How many leading chunks this pod holds.")
    tiers: dict[Tier, int] = Field(description="Those chunks by the fastest tier holding each.")
    score: float = Field(description="Tier-weighted prefix length (device 1, cpu 0.8, disk 0.5).")


class LookupResponse(BaseModel):
    num_chunks: int
    pods: list[PodPrefix] = Field(description="Pods holding at least the first chunk, best first.")
    best_pod: str | None


# ---------------------------------------------------------------- residency feed (list + watch)


class ChangeKind(StrEnum):
    POD = "pod"            # registered or re-registered: ``registration``
    GONE = "gone"          # deregistered or its lease lapsed: the pod and all its residency
    EVENTS = "events"      # an applied event batch: ``events``
    SNAPSHOT = "snapshot"  # its residency replaced whole: ``snapshot``


class ResidencyChange(BaseModel):
    """One change to the kvindex's residency, as its followers (the proxies' replicas) replay
    it: only what the index applied, in the order it applied it, per pod."""

    kind: ChangeKind
    pod: str
    registration: PodRegistration | None = None
    events: list[ResidencyEvent] | None = None
    snapshot: ChunkSnapshot | None = None


# A feed's cursor: ``<epoch>:<n>`` from an in-process kvindex, ``<ms>-<seq>`` (a stream id) from
# one on Redis. A cursor of the right form that this kvindex never issued, or no longer keeps,
# is answered 410 (state no schema can carry), one of neither form 400.
CURSOR_PATTERN = r"^(?:[0-9a-f]{8}:|[0-9]{1,20}-)[0-9]{1,20}$"


class ResidencyChanges(BaseModel):
    cursor: str = Field(description="Pass as ``after`` to get the changes that follow these.")
    changes: list[ResidencyChange]


class PodResidency(BaseModel):
    info: PodInfo
    chunks: dict[Tier, list[str]] = Field(description="Every chunk the pod holds, by tier.")


class ResidencyListing(BaseModel):
    cursor: str = Field(description="Watch from here (``/v1/residency/changes?after=``): "
                                    "every change after it may or may not be in this listing, "
                                    "and replaying it converges.")
    pods: list[PodResidency]


# ---------------------------------------------------------------- control (fan-out)


# An announced turn (a prefetch for a request not yet sent): when it is expected, and how much
# it will compute. A pod whose scheduler predicts admissions (the ShadowScheduler) then starts
# the read when the turn enters its N+1 window; any other pod reads at once.
ExpectedInS = Annotated[
    Annotated[float, Field(ge=0, le=3600), BeforeValidator(_wire_number)] | None, Field(
        description="The request needing these chunks is expected in this many seconds: a pod "
        "whose scheduler predicts admissions reads them when it predicts the request's "
        "admission within its next step; others read at once.")]
ExpectedTokens = Annotated[
    Annotated[int, Field(ge=1, le=1 << 20), BeforeValidator(_wire_int)] | None, Field(
        description="With expected_in_s: the prompt tokens the expected request will compute "
        "past these chunks (default: the pod's estimate).")]
# An announced turn's hold: the KV its pod holds now is kept there until the turn arrives.
HoldS = Annotated[
    Annotated[float, Field(gt=0, le=MAX_PIN_TTL_S), BeforeValidator(_wire_number)] | None,
    Field(description="Pin these chunks in the pod's tiers for this many seconds from now, "
          "those read from disk once they are in DRAM: the KV of an announced turn, held "
          "until it arrives. A pin like any other (it extends, never shortens, one already "
          "there; it counts against the pod's pin share) that lapses by itself.")]


class PrefetchRequest(Strict):
    chunk_hashes: list[ChunkHash] = Field(min_length=1)
    pod: str | None = None
    lookup_id: str | None = None
    expected_in_s: ExpectedInS = None
    expected_tokens: ExpectedTokens = None
    hold_s: HoldS = None


class EvictRequest(Strict):
    chunk_hashes: list[ChunkHash] = Field(min_length=1)
    locations: list[EvictLocation] | None = Field(
        default=None, description="Tiers or LMCache backends; none means every tier."
    )
    pod: str | None = None
    session_id: SessionId | None = Field(
        default=None, description="The session asking (of the caller's tenant): its own "
        "references never protect."
    )
    force: StrictBool = Field(default=False,
                              description="Evict even chunks other sessions reference or pin.")
    priority: Priority | None = Field(
        default=None, description="The evict's priority: chunks that only live sessions below it "
        "reference are evicted, a pinned session's are kept. Default: the asking session's "
        f"priority, else {DEFAULT_PRIORITY}.")


class PodCallResult(BaseModel):
    ok: bool
    num_chunks: int = Field(description="Chunks sent to this pod.")
    status_code: int | None = None
    response: dict | None = None
    error: str | None = None


class FanoutResponse(BaseModel):
    lookup_id: str | None = None
    results: dict[str, PodCallResult]
    missing: list[str] = Field(description="Chunks no live pod holds.")
    protected: list[str] = Field(
        default_factory=list, description="Chunks kept because another live session references "
        "them and is pinned or at the evict's priority or above."
    )


# ---------------------------------------------------------------- memory API (seed 000)


LM_URL_PATTERN = r"^lm://[^/\x00-\x20\x7f:]+:[0-9]{1,5}$"


def _check_lm_url(value: str) -> str:
    if not re.match(LM_URL_PATTERN, value):
        raise ValueError("must be an lm://HOST:PORT address (a KV server)")
    return value


LmUrlStr = Annotated[str, AfterValidator(_check_lm_url), WithJsonSchema({
    "type": "string", "pattern": LM_URL_PATTERN,
    "description": "A KV server's LMCache-protocol address, lm://HOST:PORT."})]


class MemoryPullRequest(Strict):
    source: LmUrlStr = Field(description="The KV server holding the chunks (a prefill pod's "
                             "own, as its answer named it).")
    chunk_hashes: list[ChunkHash]
    timeout_s: float = Field(default=30.0, gt=0, le=600, description="Longest the pull may "
                             "take; what arrived by then stays.")


class MemoryPullResult(BaseModel):
    num_pulled: int = Field(description="Chunks read into the DRAM tier (per rank: summed).")
    num_held: int = Field(description="Chunks the DRAM tier held already: not read again.")
    num_missing: int = Field(description="Chunks the source did not have.")
    pulled_bytes: int
    seconds: float


class MemoryPrefetchRequest(Strict):
    chunk_hashes: list[ChunkHash]
    lookup_id: str | None = None
    expected_in_s: ExpectedInS = None
    expected_tokens: ExpectedTokens = None
    hold_s: HoldS = None


class MemoryPrefetchResponse(BaseModel):
    # scheduled: an announced request the pod's scheduler will read for when it is due
    status: Literal["prefetch_started", "prefetch_scheduled"] = "prefetch_started"
    lookup_id: str | None
    num_chunks: int


class MemoryEvictRequest(Strict):
    chunk_hashes: list[ChunkHash]
    locations: list[PodEvictLocation] | None = None


class MemoryEvictResponse(BaseModel):
    status: Literal["success"] = "success"
    num_evicted: int


# ---------------------------------------------------------------- sessions


class IntentChunks(Strict):
    chunk_hashes: list[ChunkHash]


class SessionInfo(BaseModel):
    session_id: str
    parent: str | None = None
    intents: dict[str, list[str]]
    created_at: float
    updated_at: float = Field(description="Last write (intents, pin, release, priority): "
                              "what the idle TTL counts from.")
    priority: int = Field(default=DEFAULT_PRIORITY,
                          description="Eviction priority: an evict at or below it keeps this "
                          "session's chunks.")
    pinned_until: float | None = Field(
        default=None, description="While the pin holds, no other session's evict (at any "
        "priority) takes this session's chunks; null: not pinned.")
    expires_at: float | None = Field(
        default=None, description="When the session expires idle (its references stop "
        "protecting, then it is reaped); a pin extends it. Null: never.")


class SessionRoute(Strict):
    """What the proxy keeps of a session's last turn to route its next: shared by every proxy
    replica through the kvindex (``proxy --shared-sessions``), so any replica routes a turn
    as the one that served the session's last, and a restarted proxy forgets nothing."""
    turns: NonNegWireInt = Field(description="Turns served; a replica adopts a record with "
                                 "more turns than it has seen.")
    chunk_hashes: list[ChunkHash] = Field(default_factory=list,
                                          description="The last turn's chunk hashes.")
    last_pod: str | None = Field(default=None, max_length=253,
                                 description="The pod that prefilled the last turn.")
    last_decode_pod: str | None = Field(default=None, max_length=253,
                                        description="The pod holding the session's context.")
    prompt_tokens: NonNegWireInt | None = None
    prompt_chars: NonNegWireInt | None = None


# The intent under which each session's context is kept: the chunk hashes of its latest turn,
# written by the proxy after every turn. A session thus exists from its first turn, and its
# context is referenced (so a fork or another live session keeps it) and freed on close.
CONTEXT_INTENT = "~context"


class SessionContext(Strict):
    """A turn's context, written by the proxy after the turn (one call per turn)."""
    chunk_hashes: list[ChunkHash] | None = Field(
        default=None, description="The turn's prompt chunk hashes, in order: they become the "
        "session's context (intent '~context'). null: the context stays as it was (the engine "
        "named no chunks); the session is still created or touched.")
    route: SessionRoute | None = Field(
        default=None, description="The proxy's routing record, kept as PUT .../route keeps "
        "it (--shared-sessions), in the same call.")
    evict_dropped: StrictBool = Field(
        default=False, description="When the new chain leaves the previous context before its "
        "end (the agent compacted or edited its history), evict the chunks only the dropped "
        "part held from every tier of every pod; any other live session's reference keeps a "
        "chunk.")


class ContextWritten(BaseModel):
    session: SessionInfo
    dropped: list[str] = Field(default_factory=list, description="Chunks of the previous "
                               "context the new one left (context change), in chain order.")
    evict: FanoutResponse | None = Field(default=None, description="Their eviction, when "
                                         "asked for and any were dropped.")


class PinRequest(Strict):
    ttl_s: PinTtl = Field(description="Seconds to keep the session's chunks, e.g. the "
                          "predicted tool gap; the pin then lapses by itself.")
    pods: list[PodName] = Field(
        default_factory=list, max_length=8,
        description="The pods the session's last turn ran on, asked to pin every chunk of "
        "the session: their residency reports may not name the turn's chunks yet. The pods "
        "known to hold the chunks are asked in any case.")


class PriorityRequest(Strict):
    priority: Priority


class SessionClosed(BaseModel):
    session_id: str
    chunk_hashes: list[str] = Field(description="The chunks the session referenced.")
    evict: FanoutResponse = Field(description="Their eviction from every tier of the pods "
                                  "holding them; `protected` lists those another live "
                                  "session still references.")


class ForkRequest(Strict):
    child: SessionId = Field(description="The child's id, in the parent's tenant.")


class StoredResponse(BaseModel):
    """A Responses API object kept with the conversation behind it, so whichever proxy replica
    a continuation (``previous_response_id``) reaches can rebuild its prompt."""
    response: dict[str, Any] = Field(
        description="The Responses API object as returned to the client.")
    messages: list[dict[str, Any]] = Field(
        description="The chat messages a continuation's prompt starts with, the response's "
        "own output included.")
    session_id: str | None = Field(
        default=None, description="The agent session the response belongs to, if any, as "
        "the proxy names it.")
    ttl_s: float | None = Field(
        default=None, gt=0,
        description="Seconds to keep it; null: the kvindex's --stored-response-ttl, which is "
        "also the most it keeps one. An answer carries the TTL it was stored with.")


class StoredResponseDeleted(BaseModel):
    """OpenAI's answer to deleting a response, so the proxy can pass it through."""
    id: str = Field(description="The deleted response's id.")
    object: Literal["response"] = Field(default="response", description="Always 'response'.")
    deleted: bool = Field(default=True, description="Always true: a miss is a 404.")


# ---------------------------------------------------------------- memory API, details (worker)
# Supersets of the seed's response bodies: a seed client reads status/num_* and ignores the rest.


class MemoryPrefetchResult(MemoryPrefetchResponse):
    num_to_load: int = Field(default=0, description="Chunks found on disk only: being loaded.")
    num_in_cpu: int = Field(default=0, description="Chunks already in DRAM.")
    num_missing: int = Field(default=0, description="Chunks no tier holds (not an error).")
    missing: list[str] = Field(default_factory=list)
    num_held: int = Field(default=0, description="With hold_s: chunks the hold pinned, or "
                          "whose pin it extended, now (those still to be read are pinned once "
                          "they are in DRAM).")


class MemoryPrefetchStatus(BaseModel):
    lookup_id: str
    state: Literal["running", "done", "failed", "unknown"]
    requested: int = 0
    to_load: int = 0
    loaded: int = 0
    corrupt: int = 0
    in_cpu: int = 0
    missing: int = 0
    error: str | None = None


class MemoryEvictResult(MemoryEvictResponse):
    num_missing: int = Field(default=0, description="Chunks not held in those locations.")
    missing: list[str] = Field(default_factory=list)
    num_evicted_kv_server: int | None = Field(
        default=None, description="Chunks the KV server the pod hands P/D KV through dropped "
        "too (an evict of every tier); null when the pod has none or it could not be asked.")


class MemoryPinRequest(Strict):
    chunk_hashes: list[ChunkHash]
    ttl_s: PinTtl = Field(description="Seconds the pod's tiers keep these chunks out of their "
                          "own eviction; pinning again extends it.")


class MemoryPinResult(BaseModel):
    num_pinned: int = Field(default=0, description="Chunks newly pinned.")
    num_extended: int = Field(default=0, description="Chunks already pinned: TTL extended.")
    num_missing: int = Field(default=0, description="Chunks no tier holds (not an error).")
    num_refused: int = Field(default=0, description="Chunks past the pod's pin bound "
                             "(its --pin-share of DRAM): left to the tiers' own eviction.")
    num_pinned_kv_server: int | None = Field(
        default=None, description="Chunks the KV server the pod hands P/D KV through pinned "
        "or extended too; null when the pod has none or it could not be asked.")


class MemoryUnpinRequest(Strict):
    chunk_hashes: list[ChunkHash]


class MemoryUnpinResult(BaseModel):
    num_unpinned: int = Field(description="Pins given back (the chunks stay, evictable again).")
    num_unpinned_kv_server: int | None = Field(
        default=None, description="Pins the pod's KV server gave back too; null when the pod "
        "has none or it could not be asked.")


class MemoryChunks(BaseModel):
    """What a pod's tiers hold right now (its memory API's ``GET /memory/chunks``)."""

    chunks: dict[Tier, list[str]]
    bytes: dict[Tier, int] = Field(default_factory=dict)
