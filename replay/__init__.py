"""Trajectory replay: agent-session traces, the teacher-forced replay client, the local fleet,
the main job (``agentserving compare``) and its report. The full guide is docs/replay.md.

Modules:

- ``trace`` — the ``agentserving.sessions/v1`` JSONL format (its docstring is the format's
  reference) and its resolution into the exact token ids every turn sends;
- ``tokens`` — deterministic token ids for named blocks and per-turn content;
- ``mooncake`` — the Mooncake FAST'25 trace as sessions (the grouping rule is documented there);
- ``importers`` — real agent workloads counted in the serving model's tokens and chat
  template: mini-swe-agent's SWE-bench runs, MTRAG-UN's RAG conversations, and the agent mix
  of both with Mooncake's chats (``bundled:agent-mix``, shipped in ``workloads/``); how
  prefix-stable such conversations are under a real template (``importers.stability``);
- ``synthetic`` — seeded generator of agent sessions, with the ``agent``, ``bench-agent`` (the
  main job's) and ``bench-small`` presets; ``loader`` opens any of these (``bundled:NAME``);
- ``ideal`` — the ideal prefix hit rate of a trace (an unbounded cache); ``stats`` — a trace's
  shape, per source too;
- ``client`` — the asynchronous replay client (``agentserving replay``); ``metrics`` — the run
  metrics; ``report`` — report.json, the side-by-side table and plots (``agentserving report``);
- ``fleet`` — kvindex, workers and proxy as supervised processes (``agentserving up``);
- ``compare`` — baseline vs agentserving on one workload (``agentserving compare``, ``make run``).
"""
