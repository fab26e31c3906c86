"""The worker runtime of prefill and decode pods (``agentserving worker``).

Two kinds of process per pod, as in vLLM v1:

- the API process (``worker``, ``api/``): the OpenAI-compatible HTTP API, tokenization,
  the memory API on ``memory_port_start`` that forwards to every engine process and merges
  (seed 000), the residency book and the kvindex reporter (``reporter``), ``/metrics``;
- engine processes (``engine_process``): the model (``model/``), the step loop
  (``core``, scheduling decisions from a policy in ``scheduler/``), the KV chunk store on
  LMCache's CPU and disk tiers with checksums (``kv/``), their own memory API and the P/D
  hand-off endpoint on ``memory_port_start + 1 + k``.

They talk over ZMQ (``ipc``). The roles' own code sits below the engine, which composes it:
``services/prefill`` (the pure prefill scheduling policies) and ``services/decode/handoff``
(the P/D hand-off: its wire format, the prefill pod's source, the decode pod's pull).
"""
