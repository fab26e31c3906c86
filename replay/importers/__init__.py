"""Importers of real agent workloads into the replay's session format.

Each reads one public dataset in place and writes ``agentserving.sessions/v1`` sessions that
carry token counts, shared-block ids and timings, never text:

- ``mini_swe_agent`` — SWE-bench runs of mini-swe-agent (``*.traj.json``), one session per run,
  one turn per model call (``agentserving trace mini-swe-agent``);
- ``mtrag`` — MTRAG-UN's human multi-turn RAG conversations (``agentserving trace mtrag``);
- ``agent_mix`` — SWE sessions, MTRAG conversations and Mooncake chats in seed 003's
  proportions (``agentserving trace agent-mix``, the bundled ``agent-mix`` workload).

What they share: ``templated`` turns a conversation into the serving model's token counts
(its own tokenizer and chat template; shared text named by its digest), ``scaling`` fits those
counts and times to the fleet (token, output and time scales, the context cap), ``reading``
opens the files and names the file and field of anything malformed; ``stability`` checks
whether a conversation stays prefix-stable in a template (``bench/prefix_stability_bench.py``).
"""
