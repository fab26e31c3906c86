"""Tiny synthetic files in the shapes of the real workloads (mini-swe-agent trajectories,
MTRAG lines, Mooncake requests), written to a test's tmp_path; and where the real ones are."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[3] / "shared/data"
SWE_REAL = DATA / "mini-swe-agent/deepseek-swebench-pr814.tar.gz"
MTRAG_REAL = DATA / "mtrag/mtragun-reference.jsonl"
MOONCAKE_REAL = DATA / "mooncake/conversation_trace.jsonl"

SYSTEM = "You are a careful assistant that works in a shell to fix software. " * 5
BEFORE = "<pr_description>\nConsider the following PR description:\n"
AFTER = "\n</pr_description>\n\n<instructions>\n" + "Run one command per step. " * 20 + \
    "\n</instructions>\n"
TEMPLATE = BEFORE + "{{task}}" + AFTER


def step(text: str, command: str, outputs: list[tuple[str, float]], *, usage: bool = True,
         then_user: str | None = None) -> dict[str, Any]:
    """One model call: its text, its bash command, the tool results (text, seconds after the
    reply) and optionally a user message after them."""
    return {"text": text, "command": command, "outputs": outputs, "usage": usage,
            "then_user": then_user}


def trajectory(instance: str, task: str, steps: list[dict[str, Any]], t0: float = 1000.0
               ) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": BEFORE + task + AFTER.removesuffix("\n")}]
    t = t0
    for i, s in enumerate(steps):
        t += 2.0  # the model's answer takes 2 s
        extra: dict[str, Any] = {"timestamp": t, "response": {"created": t - 2.0}}
        if s["usage"]:
            extra["response"]["usage"] = {"prompt_tokens": 100 * (i + 1),
                                          "prompt_cache_hit_tokens": 90 * i,
                                          "completion_tokens": 10 + i}
        messages.append({"role": "assistant", "content": s["text"], "tool_calls": [
            {"function": {"name": "bash", "arguments": json.dumps({"command": s["command"]})},
             "id": f"call_{i}", "type": "function"}], "extra": extra})
        for out, after_s in s["outputs"]:
            messages.append({"role": "tool", "tool_call_id": f"call_{i}",
                             "content": f"<returncode>0</returncode>\n<output>\n{out}\n</output>",
                             "extra": {"timestamp": t + after_s, "returncode": 0}})
        if s["outputs"]:
            t += s["outputs"][-1][1]
        if s["then_user"]:
            messages.append({"role": "user", "content": s["then_user"],
                             "extra": {"interrupt_type": "FormatError"}})
    messages.append({"role": "exit", "content": "", "extra": {"exit_status": "Submitted"}})
    return {"instance_id": instance, "trajectory_format": "mini-swe-agent-1.1",
            "info": {"exit_status": "Submitted", "config": {
                "agent": {"system_template": SYSTEM + "\n", "instance_template": TEMPLATE},
                "model": {"model_name": "deepseek/deepseek-chat"}}},
            "messages": messages}


def two_trajectories() -> dict[str, dict[str, Any]]:
    """Relative path -> trajectory: two tasks of one set (the second starts 50 s later)."""
    one = trajectory("proj__proj-1", "The parser drops the last line of a file.", [
        step("Let me look at the parser.", "grep -n parse src/*.py",
             [("src/p.py:3: def parse", 0.5)]),
        step("", "sed -n 1,20p src/p.py", [("part one", 0.25), ("part two", 1.5)],
             then_user="Tool call error: say more"),
        step("Submitting.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", [], usage=False)])
    two = trajectory("proj__proj-2", "Dates before 1970 are printed wrong.", [
        step("I will reproduce it first.", "python -c 'print(1)'", [("1", 3.0)]),
        step("Done.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", [])], t0=1050.0)
    return {"output/setA/proj__proj-1/proj__proj-1.traj.json": one,
            "output/setA/proj__proj-2/proj__proj-2.traj.json": two}


def write_tree(root: Path, files: dict[str, Any]) -> Path:
    for rel, doc in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc))
    return root


def mtrag_line(conversation: str, turns: list[tuple[str, str]], target: str,
               passages: list[str], *, t0: float = 1_700_000_000.0,
               pause_s: float = 600.0) -> dict[str, Any]:
    """``turns``: (question, answer) pairs; the last question is the cut turn (its answer is
    ignored: ``target`` answers it)."""
    inp, t = [], t0
    for n, (question, answer) in enumerate(turns):
        inp.append({"speaker": "user", "text": question, "metadata": {"created_at": t}})
        if n < len(turns) - 1:
            inp.append({"speaker": "agent", "text": answer, "metadata": {"created_at": t + 5}})
            t += 5 + pause_s
    return {"conversation_id": conversation, "task_id": f"{conversation}<::>{len(turns)}",
            "turn": str(len(turns)), "Collection": "govt",
            "contexts": [{"document_id": f"d{i}", "text": p} for i, p in enumerate(passages)],
            "input": inp, "targets": [{"speaker": "agent", "text": target,
                                       "metadata": {"created_at": t + 7}}]}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def mooncake_rows() -> list[dict[str, Any]]:
    """Three two-turn chats and one single-turn request (512-token hash blocks)."""
    rows = []
    for c in range(3):
        a, b = 100 + 10 * c, 101 + 10 * c
        rows.append({"timestamp": 1000 * c, "input_length": 1100, "output_length": 50,
                     "hash_ids": [0, a, b]})
        rows.append({"timestamp": 1000 * c + 90_000, "input_length": 1700,
                     "output_length": 70, "hash_ids": [0, a, b, 900 + c]})
    rows.append({"timestamp": 5000, "input_length": 600, "output_length": 5, "hash_ids": [0, 7]})
    return rows
