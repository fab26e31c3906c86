"""Prefix stability of real agent prompts under a real chat template, and the cost of counting.

    python -m bench prefix_stability [--quick] [--model smollm2] [--src RUNS]
                                     [--out bench/results/prefix_stability.json]

For every model call of the mini-swe-agent SWE-bench runs (``--src``: the shared tarball),
rendered through the model's chat template (SmolLM2's ChatML by default) with mini-swe-agent's
bash tool: does the prompt, as token ids, start with the previous prompt's ids followed by the
previous reply tokenized on its own plus the end-of-turn token? Two ways of sending the reply
back: the template as is (the assistant message carries its tool call in ``tool_calls``,
which ChatML does not render) and the tool call written into the reply's text as
mini-swe-agent's ```bash block (what the importer does). Each break is classified by
``agentserving.replay.importers.stability`` (where the texts, else the tokens, first differ).

It also times the two ways of counting every call's prompt for the importer: tokenizing each
whole templated prompt, and ``PromptCounter`` (each piece between special tokens once), on the
same sessions, and extrapolates the first to all of them. --quick: 8 sessions, counting timed
on 1 (full: every session, counting timed on 3).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import add_out_args, progress, write_result

DEFAULT_SRC = Path("../shared/data/mini-swe-agent/deepseek-swebench-pr814.tar.gz")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench prefix_stability", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", type=Path, default=DEFAULT_SRC,
                   help="mini-swe-agent runs: a folder, a .traj.json or a .tar.gz")
    p.add_argument("--model", default="smollm2", help="whose tokenizer and chat template")
    p.add_argument("--sessions", type=int, default=None,
                   help="only the first N runs (default: all; 8 with --quick)")
    add_out_args(p, Path("bench/results/prefix_stability.json"), "8 runs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.sessions is None and args.quick:
        args.sessions = 8
    return args


def session_checks(tok: Any, name: str, doc: Any) -> dict[str, list[str]]:
    """Per mode, the verdict of every call after the first."""
    from agentserving.engine.model.tokenizer import PromptCounter
    from agentserving.replay.importers.mini_swe_agent import BASH_TOOL, chat_messages
    from agentserving.replay.importers.reading import Fields
    from agentserving.replay.importers.stability import check_turn

    f = Fields(name, doc)
    in_text, calls, replies = chat_messages(f, doc["messages"], calls_in_text=True)
    as_is, _, texts = chat_messages(f, doc["messages"], calls_in_text=False)
    end = tok.end_of_turn
    out: dict[str, list[str]] = {}
    for mode, chat in (("template as is", as_is), ("tool calls in the text", in_text)):
        counter = PromptCounter(tok)
        prompts = []
        for at in calls:
            text = tok.render_chat(chat[:at], add_generation_prompt=True, tools=[BASH_TOOL])
            prompts.append((text, counter.ids(text)))
        verdicts = []
        for k in range(1, len(calls)):
            reply, own = replies[k - 1], texts[k - 1]
            verdicts.append(check_turn(
                prev_text=prompts[k - 1][0], prev_ids=prompts[k - 1][1], reply=reply,
                # the tool call's text starts where the message's own text ends
                call_at=len(own) if len(reply) > len(own) else None, end=end,
                out_ids=counter.ids(reply + end), text=prompts[k][0], ids=prompts[k][1]))
        out[mode] = verdicts
    return out


def counting_speed(tok: Any, name: str, doc: Any) -> dict[str, float]:
    """Seconds to count one run's prompts: each whole prompt tokenized, and the counter."""
    from agentserving.engine.model.tokenizer import PromptCounter
    from agentserving.replay.importers.mini_swe_agent import BASH_TOOL, chat_messages
    from agentserving.replay.importers.reading import Fields

    chat, calls, _ = chat_messages(Fields(name, doc), doc["messages"], calls_in_text=True)
    texts = [tok.render_chat(chat[:at], add_generation_prompt=True, tools=[BASH_TOOL])
             for at in calls]
    t0 = time.perf_counter()
    whole = [len(tok.prompt_ids(t)) for t in texts]
    t1 = time.perf_counter()
    counter = PromptCounter(tok)
    pieces = [counter.count_prompt(t) for t in texts]
    t2 = time.perf_counter()
    if whole != pieces:
        raise AssertionError(f"{name}: the counter's counts differ from whole prompts'")
    return {"calls": len(texts), "prompt_tokens": sum(whole), "whole_prompts_s": t1 - t0,
            "counter_s": t2 - t1}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from agentserving.engine.model.tokenizer import load_tokenizer
    from agentserving.replay.importers.mini_swe_agent import PATTERN
    from agentserving.replay.importers.reading import JsonSource
    from agentserving.replay.importers.stability import BREAKS, STABLE

    if not args.src.exists():
        print(f"{args.src}: not found (the shared mini-swe-agent runs)", file=sys.stderr)
        return 2
    tok = load_tokenizer(args.model)
    source = JsonSource(args.src, PATTERN)
    members = source.members[:args.sessions] if args.sessions else source.members
    timed_runs = 1 if args.quick else 3
    verdicts: dict[str, Counter[str]] = {}
    timing: list[dict[str, float]] = []
    started = time.perf_counter()
    with progress(not args.no_progress) as bar:
        task = bar.add_task("prefix stability", total=len(members))
        for i, (_, name, doc) in enumerate(source.load(members)):
            for mode, found in session_checks(tok, name, doc).items():
                verdicts.setdefault(mode, Counter()).update(found)
            if i < timed_runs:
                timing.append(counting_speed(tok, name, doc))
            bar.advance(task)
    modes = {}
    for mode, counts in verdicts.items():
        turns = sum(counts.values())
        modes[mode] = {"turns": turns, "stable": counts[STABLE],
                       "stable_share": counts[STABLE] / turns if turns else None,
                       "breaks": {b: counts[b] for b in BREAKS if counts[b]}}
    whole_s = sum(t["whole_prompts_s"] for t in timing)
    tokens = sum(t["prompt_tokens"] for t in timing)
    result = {
        "model": args.model, "template": tok.template_id, "src": str(args.src),
        "sessions": len(members), "quick": args.quick, "modes": modes,
        "counting": {"timed_sessions": len(timing), "calls": sum(t["calls"] for t in timing),
                     "prompt_tokens": tokens, "whole_prompts_s": whole_s,
                     "counter_s": sum(t["counter_s"] for t in timing),
                     "whole_prompt_tokens_per_s": tokens / whole_s if whole_s else None},
        "wall_s": time.perf_counter() - started,
    }
    for mode, m in modes.items():
        print(f"{mode}: {m['stable']} of {m['turns']} turns prefix-stable "
              f"({100 * (m['stable_share'] or 0):.1f}%); breaks: {m['breaks'] or 'none'}")
    c = result["counting"]
    print(f"counting {c['calls']} calls ({c['prompt_tokens']:,} prompt tokens): whole prompts "
          f"{c['whole_prompts_s']:.1f} s, PromptCounter {c['counter_s']:.2f} s")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
