"""mini-swe-agent trajectories (``*.traj.json``) as replay sessions.

A trajectory is one agent solving one SWE-bench task: the messages it sent to the model, in
order (system, the task as a user message, then per step the assistant's reply with its bash
tool call and the tool's result; ``exit`` ends it). Each becomes one session, each assistant
message (a model call) one turn:

- **input**: what an OpenAI client appends before that call, in the serving model's chat
  template (``templated``): turn 0 the templated system and task messages; later turns the
  tool results and user messages since the previous reply, with the template's glue and
  generation prompt. mini-swe-agent's bash tool schema goes to the template as ``tools``.
- **output**: the reply as the model emits it plus the end-of-turn token. Where the template
  renders no tool calls (SmolLM2's ChatML and the tiny model's do not: checked by rendering
  with and without one), each tool call is written into the reply's text as mini-swe-agent's
  own text-mode action block, ``"```bash\\n<command>\\n```"``, so the command the model
  emitted is in its output and in every later prompt, as it was for DeepSeek.
- **shared text**: the template's preamble, the system message and the instance template's
  text before the task are the same in every task with that configuration: shared blocks at
  the start of turn 0. The instance template's text after the task (the instructions) and the
  template's glue after it are the same too: shared blocks after the task (a ``parts`` input),
  which a prefix cache correctly cannot reuse. Block ids come from a digest of the text.
- **times**: ``tool_gap_s`` is the tool's end (its message's ``extra.timestamp``, the last
  one if several) minus the reply's ``extra.timestamp``; ``start_s`` the first call's time
  (``extra.response.created``, else its ``extra.timestamp``) after the source's earliest.
- **meta**: per turn the usage DeepSeek billed (``usage``: ``prompt_tokens``,
  ``prompt_cache_hit_tokens``, ``completion_tokens``) and the real ``input_tokens`` /
  ``output_tokens``; per session ``source``, ``instance_id``, ``set`` (the run's folder,
  e.g. ``deepseek_bench1``), ``exit_status`` and ``model``.

A run that ended before any model call (an ``exit_status`` such as ``Timeout`` or
``InternalServerError`` with only the system, task and exit messages) has nothing to replay: it
is skipped and counted in the header's ``runs_skipped`` (``strict`` makes it an error, as any
malformed file is).

Sizes and times are then scaled to the fleet (``scaling``; defaults below).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.engine.model.tokenizer import Tokenizer
from agentserving.replay.importers.reading import Fields, JsonSource
from agentserving.replay.importers.scaling import (
    MAIN_JOB_CONTEXT,
    ImportedSession,
    ImportedTurn,
    Scaling,
    fit_session,
    fit_sessions,
    trace_of,
)
from agentserving.replay.importers.templated import Call, count_calls, renders_tool_calls
from agentserving.replay.trace import Session, Trace, TraceFormatError

SOURCE = "mini-swe-agent"
PATTERN = "*.traj.json"
DEFAULT_SCALING = Scaling(token_scale=0.25, output_scale=0.1, time_scale=0.2,
                          max_context=MAIN_JOB_CONTEXT)
# mini-swe-agent's bash tool, as its tool-calling models declare it
BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Execute a bash command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string",
                                       "description": "The bash command to execute"}},
            "required": ["command"],
        },
    },
}
CHAT_ROLES = ("system", "user", "assistant", "tool")
USAGE_KEYS = ("prompt_tokens", "prompt_cache_hit_tokens", "completion_tokens")


class NoModelCall(TraceFormatError):
    """A run without an assistant message: nothing to replay, not a malformed file."""

    reason = "no model call"

    def __init__(self, name: str, exit_status: str | None) -> None:
        self.exit_status = exit_status
        super().__init__(f"{name}: messages: no assistant message ({self.reason}; exit status "
                         f"{exit_status})")


@dataclass(frozen=True)
class SkippedRun:
    """A run left out of the trace, and why."""

    file: str
    reason: str
    exit_status: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "reason": self.reason, "exit_status": self.exit_status}


@dataclass
class Imported:
    """The sessions a source gave, and the runs it held that give none."""

    sessions: list[ImportedSession]
    skipped: list[SkippedRun]

    def header(self) -> dict[str, Any]:
        """What the trace's header records about the runs read."""
        return {"sessions_read": len(self.sessions),
                "runs_skipped": {"count": len(self.skipped),
                                 "runs": [r.as_dict() for r in self.skipped]}}


@dataclass(frozen=True)
class Step:
    """What the trajectory says about one model call besides its text."""

    message: int  # index in the trajectory's messages
    time_s: float  # when the reply arrived
    started_s: float  # when the call was made (the reply's ``created``, else time_s)
    tool: str | None
    tool_done_s: float | None  # the last tool result's time before the next call
    usage: dict[str, int] | None


def action_block(command: str) -> str:
    return f"```bash\n{command}\n```"


def _tool_calls(f: Fields, i: int) -> list[tuple[str, str]]:
    """(function name, arguments as sent) per tool call of message ``i``."""
    calls = f.get(f"messages[{i}].tool_calls", list, required=False) or []
    out = []
    for j, _ in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}].function"
        name = f.get(f"{where}.name", str)
        arguments = f.get(f"{where}.arguments", (str, dict), required=False,
                          default="")
        out.append((name, arguments if isinstance(arguments, str) else json.dumps(arguments)))
    return out


def _command(arguments: str) -> str:
    """The bash command of a call's arguments; the raw arguments when they do not parse (a
    model's malformed call, which mini-swe-agent answered with a format error)."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(args, dict) and isinstance(args.get("command"), str):
        return str(args["command"])
    return arguments


def chat_messages(f: Fields, messages: list[Any], *, calls_in_text: bool
                  ) -> tuple[list[dict[str, Any]], list[int], list[str]]:
    """The messages as a client sends them, the chat index of every assistant message and its
    reply as the model emitted it."""
    chat: list[dict[str, Any]] = []
    calls: list[int] = []
    replies: list[str] = []
    for i, _ in enumerate(messages):
        role = f.get(f"messages[{i}].role", str)
        if role not in CHAT_ROLES:  # "exit": the run's end, never sent
            continue
        content = f.get(f"messages[{i}].content", (str, list), required=False,
                        default="")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        msg: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            tool_calls = _tool_calls(f, i)
            if calls_in_text:
                blocks = [action_block(_command(args)) for _, args in tool_calls]
                content = "\n\n".join(([content] if content else []) + blocks)
                msg["content"] = content
            elif tool_calls:
                msg["tool_calls"] = [
                    {"type": "function", "id": f"call_{i}_{j}",
                     "function": {"name": name, "arguments": _arguments(args)}}
                    for j, (name, args) in enumerate(tool_calls)]
            calls.append(len(chat))
            replies.append(content)
        chat.append(msg)
    return chat, calls, replies


def _arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def steps(f: Fields, messages: list[Any]) -> list[Step]:
    """Every model call's times, tool and billed usage, in order."""
    out: list[Step] = []
    roles = [f.get(f"messages[{i}].role", str) for i in range(len(messages))]
    for i, role in enumerate(roles):
        if role != "assistant":
            continue
        time_s = f.number(f"messages[{i}].extra.timestamp")
        created = f.number(f"messages[{i}].extra.response.created", required=False)
        done = None
        for j in range(i + 1, len(messages)):
            if roles[j] == "assistant":
                break
            if roles[j] == "tool":
                done = f.number(f"messages[{j}].extra.timestamp")
        calls = _tool_calls(f, i)
        usage = None
        if f.get(f"messages[{i}].extra.response.usage", dict, required=False):
            usage = {k: int(f.get(f"messages[{i}].extra.response.usage.{k}", int))
                     for k in USAGE_KEYS}
        out.append(Step(i, float(time_s or 0.0), float(created if created is not None
                                                       else time_s or 0.0),
                        calls[0][0] if calls else None, done, usage))
    return out


def template_parts(f: Fields, task_message: str) -> tuple[str | None, str | None]:
    """The instance template's text before and after the task, as the task message carries
    them (Jinja drops one trailing newline), or None where the message does not."""
    template = f.get("info.config.agent.instance_template", str, required=False)
    if not template or "{{task}}" not in template:
        return None, None
    before, after = template.split("{{task}}", 1)
    head = before if before and task_message.startswith(before) else None
    tail = None
    for candidate in (after, after.removesuffix("\n")):
        if candidate and task_message.endswith(candidate):
            tail = candidate
            break
    return head, tail


def import_trajectory(tokenizer: Tokenizer, name: str, path: str, doc: Any, *,
                      calls_in_text: bool) -> ImportedSession:
    """One trajectory as a session at real sizes (``start_s`` is the absolute time); ``path``
    is the file's (``<set>/<instance>/<instance>.traj.json`` names the set)."""
    f = Fields(name, doc)
    if not isinstance(doc, dict):
        raise f.error("(top level)", "expected an object")
    messages = f.get("messages", list)
    chat, call_at, replies = chat_messages(f, messages, calls_in_text=calls_in_text)
    if not call_at:
        raise NoModelCall(name, f.get("info.exit_status", str, required=False))
    facts = steps(f, messages)
    first_user = next((m["content"] for m in chat if m["role"] == "user"), "")
    head, tail = template_parts(f, first_user)
    system = next((m["content"] for m in chat if m["role"] == "system"), None)
    calls = [Call(messages=chat[:at], reply=reply,
                  shared_until=(head or system or None) if k == 0 else None,
                  shared_from=tail if k == 0 else None)
             for k, (at, reply) in enumerate(zip(call_at, replies, strict=True))]
    counting = count_calls(tokenizer, calls, tools=[BASH_TOOL])
    turns = []
    for counted, step in zip(counting.calls, facts, strict=True):
        gap = max(0.0, step.tool_done_s - step.time_s) if step.tool_done_s is not None else 0.0
        meta: dict[str, Any] = {"input_tokens": counted.input_tokens,
                                "output_tokens": counted.output_tokens}
        if step.usage is not None:
            meta["usage"] = step.usage
        turns.append(ImportedTurn(counted.pieces, counted.output_tokens, tool=step.tool,
                                  gap_s=gap, meta=meta))
    parts = PurePosixPath(Path(path).as_posix()).parts
    instance = f.get("instance_id", str, required=False) or \
        parts[-1].removesuffix(".traj.json")
    run_set = parts[-3] if len(parts) >= 3 else ""
    meta = {"source": SOURCE, "instance_id": instance, "set": run_set,
            "exit_status": f.get("info.exit_status", str, required=False),
            "model": f.get("info.config.model.model_name", str, required=False)}
    sid = f"{run_set}/{instance}" if run_set else instance
    return ImportedSession(sid, facts[0].started_s, turns, meta, clamped=counting.clamped)


@dataclass(frozen=True)
class SweOptions:
    model: str = "smollm2"
    scaling: Scaling = DEFAULT_SCALING
    limit: int | None = None  # the first N trajectories (in path order)
    members: Sequence[str] | None = None  # exactly these (paths inside the source)
    strict: bool = False  # a run without a model call is an error, not skipped


def import_sessions(tokenizer: Tokenizer, source: JsonSource,
                    members: Sequence[str] | None = None, *, strict: bool = False) -> Imported:
    """Every selected trajectory at real sizes, ``start_s`` relative to the earliest; runs
    without a model call skipped (raised when ``strict``)."""
    calls_in_text = not renders_tool_calls(tokenizer)
    imported = Imported([], [])
    for member, name, doc in source.load(members):
        try:
            imported.sessions.append(import_trajectory(
                tokenizer, name, source.path_of(member), doc, calls_in_text=calls_in_text))
        except NoModelCall as exc:
            if strict:
                raise
            imported.skipped.append(SkippedRun(name, exc.reason, exc.exit_status))
    sessions = imported.sessions
    _unique_ids(sessions)
    if sessions:
        first = min(s.start_s for s in sessions)
        for s in sessions:
            s.start_s -= first
    return imported


def _unique_ids(sessions: Iterable[ImportedSession]) -> None:
    seen: dict[str, int] = {}
    for s in sessions:
        n = seen.get(s.session_id, 0)
        seen[s.session_id] = n + 1
        if n:
            s.session_id = f"{s.session_id}#{n + 1}"


def drawn_sessions(tokenizer: Tokenizer, src: str | Path, scaling: Scaling, rng: Any,
                   count: int, *, min_turns: int = 1) -> list[Session]:
    """Up to ``count`` trajectories of ``src`` in the order ``rng`` shuffles them to, each
    fitted by ``scaling``; one that fits fewer than ``min_turns`` calls (or none, or made no
    model call) is passed over for the next."""
    source = JsonSource(src, PATTERN)
    order = source.members
    rng.shuffle(order)
    kept: list[Session] = []
    for member in order:  # in the drawn order, until enough fit the context
        if len(kept) >= count:
            break
        for imported in import_sessions(tokenizer, source, [member]).sessions:
            session, _ = fit_session(imported, scaling, namespace=SOURCE,
                                     block_size=DEFAULT_CHUNK_SIZE)
            if session is not None and len(session.turns) >= min_turns:
                kept.append(session)
    return kept


def read_mini_swe_agent(src: str | Path, tokenizer: Tokenizer, opts: SweOptions) -> Trace:
    """A source of trajectories as a trace (see the module docstring)."""
    source = JsonSource(src, PATTERN)
    members = list(opts.members) if opts.members is not None else source.members
    if opts.limit is not None:
        members = members[:opts.limit]
    imported = import_sessions(tokenizer, source, members, strict=opts.strict)
    fitted = fit_sessions(imported.sessions, opts.scaling, namespace=SOURCE)
    return trace_of(fitted, source=f"{SOURCE}:{Path(src).name}",
                    generator=generator(tokenizer, opts, **imported.header()))


def generator(tokenizer: Tokenizer, opts: SweOptions, **extra: Any) -> dict[str, Any]:
    """The header's record of how the sessions were made."""
    return {"importer": "agentserving.replay.importers.mini_swe_agent", "model": opts.model,
            "template": tokenizer.template_id,
            "tool_calls": "rendered by the template" if renders_tool_calls(tokenizer)
            else "written into the reply as ```bash blocks",
            "scaling": opts.scaling.as_dict(), "limit": opts.limit, **extra}
