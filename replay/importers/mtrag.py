"""MTRAG-UN's generation tasks (human multi-turn RAG conversations) as replay sessions.

Each line of the reference file is one conversation cut at one of its turns: ``input`` is the
history up to that turn (user and agent messages, each with ``metadata.created_at``),
``contexts`` the passages retrieved for the cut turn alone, ``targets[0]`` the reply. Each
line becomes one session, each user message of ``input`` one turn; the last is the cut turn,
whose reply is ``targets[0]``; the other turns' outputs are the agent messages that follow
them. Prompts are the serving model's chat template over a fixed RAG system prompt
(``SYSTEM_PROMPT``, shared blocks named by its digest) and the history, counted as in
``templated``.

**Passage layout** (``--passages``): where the retrieved passages sit decides how much of a
turn's prompt the previous turn already computed.

- ``with-turn`` (default): the passages go into the cut turn's user message, before its
  question. Earlier turns' retrievals are not in the data, so those turns carry none; the
  history stays append-only and every turn reuses all of the previous prompt.
- ``system``: the passages go into the system message of the cut turn's prompt, as RAG
  systems that refresh their context each turn do. That prompt no longer extends the
  previous one: the cut turn is a ``context: "replace"`` turn whose only reusable part is the
  system prompt before the passages.

**Times**: a turn's gap is the human's pause, the next user message's ``created_at`` minus the
agent reply's, at least 0; ``tool`` is null. Pauses are minutes (median 12.6 min; some span
months), so the default ``time_scale`` is 1/60 (a minute becomes a second) and every scaled
pause is capped at ``max_gap_s`` (60 s: an hour-long pause is a new sitting, not a replay
wait). A session's ``start_s`` is its first message's time after the earliest line's: the
conversations were written over 200 days, so replay them with ``--rate`` or take them into a
mix (``agent_mix``) that sets its own arrivals.

Session meta: ``source`` ``"mtrag"``, ``collection``, ``task_id``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from agentserving.engine.model.tokenizer import Tokenizer
from agentserving.replay.importers.reading import Fields
from agentserving.replay.importers.scaling import (
    MAIN_JOB_CONTEXT,
    ImportedSession,
    ImportedTurn,
    Scaling,
    fit_sessions,
    trace_of,
)
from agentserving.replay.importers.templated import Call, count_calls, text_digest
from agentserving.replay.trace import Trace, TraceFormatError

SOURCE = "mtrag"
Layout = Literal["with-turn", "system"]
LAYOUTS: tuple[Layout, ...] = ("with-turn", "system")
DEFAULT_SCALING = Scaling(token_scale=1.0, output_scale=0.1, time_scale=1 / 60,
                          max_context=MAIN_JOB_CONTEXT, max_gap_s=60.0)
SYSTEM_PROMPT = (
    "You are a helpful assistant answering questions from a collection of documents. Use "
    "the documents you are given; if they do not hold the answer, say that you do not know "
    "rather than guess. Keep your answers short and to the point, and ask when a question "
    "is unclear.")


def documents(passages: list[str]) -> str:
    """The retrieved passages as the prompt carries them."""
    body = "".join(f'<document id="{i}">\n{text.strip()}\n</document>\n'
                   for i, text in enumerate(passages, 1))
    return f"<documents>\n{body}</documents>"


@dataclass(frozen=True)
class Conversation:
    conversation_id: str
    task_id: str
    collection: str | None
    messages: list[tuple[str, str, float]]  # (user|agent, text, created_at), ends with user
    target: str
    target_at: float | None
    passages: list[str]


def parse_line(f: Fields) -> Conversation:
    inp = f.get("input", list)
    if not inp:
        raise f.error("input", "empty")
    messages = []
    for i, _ in enumerate(inp):
        speaker = f.get(f"input[{i}].speaker", str)
        want = "user" if i % 2 == 0 else "agent"
        if speaker != want:
            raise f.error(f"input[{i}].speaker", f"expected {want!r} (user and agent "
                                                 f"alternate from a user message), got "
                                                 f"{speaker!r}")
        messages.append((speaker, f.get(f"input[{i}].text", str),
                         float(f.number(f"input[{i}].metadata.created_at") or 0.0)))
    if messages[-1][0] != "user":
        raise f.error(f"input[{len(inp) - 1}].speaker", "the history must end with the user "
                                                        "message the target answers")
    contexts = f.get("contexts", list, required=False) or []
    return Conversation(
        conversation_id=f.get("conversation_id", str),
        task_id=f.get("task_id", str, required=False) or "",
        collection=f.get("Collection", str, required=False),
        messages=messages, target=f.get("targets[0].text", str),
        target_at=f.number("targets[0].metadata.created_at", required=False),
        passages=[f.get(f"contexts[{j}].text", str) for j in range(len(contexts))])


def calls_of(conv: Conversation, layout: Layout) -> list[Call]:
    """One call per user message; the last (the cut turn) carries the passages."""
    history = [{"role": "system", "content": SYSTEM_PROMPT}]
    calls = []
    users = [i for i, (who, _, _) in enumerate(conv.messages) if who == "user"]
    for n, i in enumerate(users):
        cut = n == len(users) - 1
        chat = history + [{"role": "user" if who == "user" else "assistant", "content": text}
                          for who, text, _ in conv.messages[:i + 1]]
        replace = False
        if cut and conv.passages:
            docs = documents(conv.passages)
            if layout == "with-turn":
                chat[-1] = {"role": "user", "content": f"{docs}\n\n{chat[-1]['content']}"}
            else:
                chat[0] = {"role": "system", "content": f"{SYSTEM_PROMPT}\n\n{docs}"}
                replace = n > 0
        reply = conv.target if cut else conv.messages[i + 1][1]
        calls.append(Call(messages=chat, reply=reply, replace=replace,
                          shared_until=SYSTEM_PROMPT if n == 0 or replace else None))
    return calls


def import_conversation(tokenizer: Tokenizer, conv: Conversation, layout: Layout
                        ) -> ImportedSession:
    calls = calls_of(conv, layout)
    counting = count_calls(tokenizer, calls)
    users = [i for i, (who, _, _) in enumerate(conv.messages) if who == "user"]
    turns = []
    for n, (counted, call, i) in enumerate(zip(counting.calls, calls, users, strict=True)):
        gap = 0.0
        if n < len(users) - 1:  # the human's pause: reply written -> next question written
            gap = max(0.0, conv.messages[i + 2][2] - conv.messages[i + 1][2])
        turns.append(ImportedTurn(counted.pieces, counted.output_tokens, tool=None, gap_s=gap,
                                  replace=call.replace,
                                  meta={"input_tokens": counted.input_tokens,
                                        "output_tokens": counted.output_tokens}))
    meta = {"source": SOURCE, "collection": conv.collection, "task_id": conv.task_id}
    return ImportedSession(conv.conversation_id, conv.messages[0][2], turns, meta,
                           clamped=counting.clamped)


def read_conversations(path: str | Path, limit: int | None = None) -> list[Conversation]:
    out: list[Conversation] = []
    with open(path, encoding="utf-8") as file:
        for lineno, line in enumerate(file, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            name = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise TraceFormatError(f"{name}: not JSON: {exc}") from exc
            if not isinstance(obj, dict):
                raise TraceFormatError(f"{name}: expected an object")
            out.append(parse_line(Fields(name, obj)))
    return out


@dataclass(frozen=True)
class MtragOptions:
    model: str = "smollm2"
    layout: Layout = "with-turn"
    scaling: Scaling = DEFAULT_SCALING
    limit: int | None = None  # the first N conversations (file order)


def import_sessions(tokenizer: Tokenizer, conversations: list[Conversation],
                    layout: Layout) -> list[ImportedSession]:
    """The conversations at real sizes, ``start_s`` relative to the earliest."""
    sessions = [import_conversation(tokenizer, c, layout) for c in conversations]
    if sessions:
        first = min(s.start_s for s in sessions)
        for s in sessions:
            s.start_s -= first
    return sessions


def generator(tokenizer: Tokenizer, opts: MtragOptions, **extra: Any) -> dict[str, Any]:
    return {"importer": "agentserving.replay.importers.mtrag", "model": opts.model,
            "template": tokenizer.template_id, "passages": opts.layout,
            "system_prompt": text_digest(SYSTEM_PROMPT), "scaling": opts.scaling.as_dict(),
            "limit": opts.limit, **extra}


def read_mtrag(path: str | Path, tokenizer: Tokenizer, opts: MtragOptions) -> Trace:
    """An MTRAG reference file as a trace (see the module docstring)."""
    if opts.layout not in LAYOUTS:
        raise ValueError(f"passage layout must be one of {LAYOUTS}, not {opts.layout!r}")
    sessions = import_sessions(tokenizer, read_conversations(path, opts.limit), opts.layout)
    fitted = fit_sessions(sessions, opts.scaling, namespace=SOURCE)
    return trace_of(fitted, source=f"{SOURCE}:{Path(path).name}",
                    generator=generator(tokenizer, opts, sessions_read=len(sessions)))
